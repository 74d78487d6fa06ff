"""Pretraining the embedded tiny model: synthetic data that forms in-context recall (see pretrain/README.md)."""
