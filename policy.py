"""The policy: load any local HF causal LM, or build the embedded tiny one.

`load_policy("tiny")` builds (once, deterministically from a seed) a small Qwen3-architecture model with a
byte-level BPE tokenizer trained on the project's own text and a Qwen3-style chat template with tool support:
tools listed in the system turn, calls as `<tool_call>{"name":…,"arguments":…}</tool_call>`, results as
`<tool_response>…</tool_response>` inside a user turn. It is saved as an ordinary HF folder, so the tiny model
and a real checkpoint (`--model /path/to/Qwen3-4B`) go through the same loading code.

Shared by rollout.py, train.py and evaluate.py.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parent
TINY_DIR = PROJECT_ROOT / ".cache" / "tiny-qwen3"
TINY_FORMAT_VERSION = 3  # bump when the tiny recipe changes, so stale caches are rebuilt

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# A Qwen3-style ChatML template with tool support (thinking left out: the tiny model does not reason).
# Consecutive tool messages share one user turn, exactly as in Qwen3; rollout.py derives its scaffolding from
# this text. It is the tiny model's template and, via --chat-template, the one for ChatML models whose own
# template has no tools (SmolLM2). Read byte for byte: the tiny tokenizer is trained on this text.
TOOLS_TEMPLATE_PATH = PROJECT_ROOT / "chat_templates" / "chatml-tools.jinja"
CHAT_TEMPLATE = TOOLS_TEMPLATE_PATH.read_bytes().decode("utf-8")


@dataclass
class TinyConfig:
    seed: int = 0
    vocab_size: int = 4096          # BPE target; the model's embedding is rounded up to a multiple of 64
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    corpus_tasks: int = 3000        # toy-world tasks rendered into the tokenizer's training text


class PolicyLoadError(RuntimeError):
    """A model path that is missing, incomplete or corrupt; the message says which and how to fix it."""


def _renderer():
    """A throwaway tokenizer that only renders the chat template (to put whole chats in the BPE corpus)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_corpus(cfg: TinyConfig) -> list[str]:
    """The text the tiny tokenizer is trained on: chat scaffolding and whole rendered toy-world chats."""
    rng = random.Random(cfg.seed)
    lines = [CHAT_TEMPLATE]
    lines += ["You are a helpful assistant that uses tools.", "Answer the user's question.",
              '{"type": "function", "function": {"name": "f", "description": "d", "parameters": '
              '{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}',
              '{"error": "unknown tool"}', '{"error": "invalid arguments"}']
    lines += [" ".join(str(rng.randint(0, 999)) for _ in range(20)) for _ in range(200)]
    try:
        from bench import toyworld
    except ImportError:
        return lines
    lines += toyworld.corpus_text(cfg.corpus_tasks, seed=cfg.seed)
    import rehearse   # the test-time rehearsal texts, so their scaffolding compresses like the template's
    lines += [rehearse.MEMORY_HEAD, rehearse.MEMORY_TAIL, rehearse.ASSESS_PREFIX, rehearse.ASSESS_OK,
              rehearse.ASSESS_ERROR, rehearse.ASSESS_WRONG, "    assessment: ", "-> predicted"] * 50
    render = _renderer()
    for task in toyworld.load_tasks("train", limit=max(cfg.corpus_tasks // 4, 1), seed=cfg.seed):
        lines.append(render.apply_chat_template(toyworld.reference_trajectory(task), tools=task.tools,
                                                tokenize=False))
    return lines


def _entity_words() -> list[str]:
    try:
        from bench import toyworld
        return sorted(set(toyworld.NAMES + toyworld.ITEMS))
    except ImportError:
        return []


def build_tokenizer(cfg: TinyConfig):
    """Byte-level BPE whose merges may cross spaces and punctuation, so the constant scaffolding (the tool
    block, template text) compresses into few tokens, while digits and the toy world's entity names stay
    separate tokens: a 3M-parameter model then sees ~100-token chats instead of ~500 and can still copy
    names and do digit arithmetic. Lossless like any byte-level BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    steps = []
    words = _entity_words()
    if words:
        steps.append(pre_tokenizers.Split(Regex(r"\b(?:" + "|".join(words) + r")(?=s?\b)"), behavior="isolated"))
    steps += [pre_tokenizers.Digits(individual_digits=True),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    bpe.pre_tokenizer = pre_tokenizers.Sequence(steps)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS + TAG_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=48)
    bpe.train_from_iterator(tiny_corpus(cfg), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL_TOKENS[1:] + TAG_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny(path: Path, cfg: TinyConfig | None = None) -> Path:
    """Write a deterministic tiny Qwen3 model + tokenizer to `path` (atomically: temp folder, then rename)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = cfg or TinyConfig()
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = build_tokenizer(cfg)
    torch.manual_seed(cfg.seed)
    config = Qwen3Config(
        vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rope_theta=10000.0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "tiny_recipe.json").write_text(json.dumps({"version": TINY_FORMAT_VERSION, **asdict(cfg)}, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def ensure_tiny(path: Path = TINY_DIR, cfg: TinyConfig | None = None) -> Path:
    cfg = cfg or TinyConfig()
    recipe = Path(path) / "tiny_recipe.json"
    want = {"version": TINY_FORMAT_VERSION, **asdict(cfg)}
    if not recipe.exists() or json.loads(recipe.read_text()) != want:
        build_tiny(path, cfg)
    return Path(path)


def resolve_model_path(name: str) -> Path:
    """'tiny' means the embedded tiny model (built on first use); anything else must be a local HF folder."""
    if name == "tiny":
        return ensure_tiny()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise PolicyLoadError(f"model path {str(path)!r} does not exist or is not a folder; pass a local "
                              "Hugging Face checkpoint folder (config.json, weights, tokenizer) or 'tiny'")
    missing = [f for f in ("config.json",) if not (path / f).exists()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("*.safetensors weights")
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        missing.append("tokenizer.json")
    if missing:
        raise PolicyLoadError(f"model folder {str(path)!r} is incomplete: missing {', '.join(missing)}")
    return path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = resolve_model_path(str(path))
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # a corrupt tokenizer file surfaces as many exception types
        raise PolicyLoadError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc
    if not tok.chat_template:
        raise PolicyLoadError(f"the tokenizer in {str(path)!r} has no chat template; the rollout engine renders "
                              "turns with the model's own template (add one to tokenizer_config.json)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def default_attn_implementation(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_policy(name: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                attn_implementation: str | None = None):
    """(model, tokenizer) from 'tiny' or a local HF folder; clear PolicyLoadError on anything broken."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(str(name))
    tok = load_tokenizer(path)
    device = torch.device(device)
    attn = attn_implementation or default_attn_implementation(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    except Exception as exc:
        raise PolicyLoadError(f"cannot load model weights from {str(path)!r}: {type(exc).__name__}: {exc}. "
                              "The folder may be corrupt or half-written; re-save it or pick another "
                              "checkpoint") from exc
    return model.to(device), tok
