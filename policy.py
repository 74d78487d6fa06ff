"""The policy: load any local HF causal LM or .gguf file, or build the embedded tiny one.

`load_policy("tiny-init")` builds (once, deterministically from a seed) a small Qwen3-architecture model with a
byte-level BPE tokenizer trained on the project's own text and a Qwen3-style chat template with tool support:
tools listed in the system turn, calls as `<tool_call>{"name":…,"arguments":…}</tool_call>`, results as
`<tool_response>…</tool_response>` inside a user turn. `load_policy("tiny")` loads the same model after
pretraining (pretrain/: keyed recall, copying, small arithmetic), shipped in weights/tiny-recall. Both are saved
as an ordinary HF folder, so the tiny model and a real checkpoint (`--model /path/to/Qwen3-4B`) go through the same
loading code. A .gguf file is
converted once into an HF folder under .cache/gguf/ (dequantized to float32) and loaded from there.
`chat_template=FILE` replaces the tokenizer's template (chat_templates/chatml-tools.jinja gives tool support to
ChatML models without it); extra template variables live in a checkpoint's chat_template_kwargs.json.

Shared by rollout.py, train.py and evaluate.py.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedTokenizerFast, Qwen3Config,
                          Qwen3ForCausalLM)
from transformers.utils import logging as hf_logging

import chat_format
from bench import toyworld

PROJECT_ROOT = Path(__file__).resolve().parent
TINY_DIR = PROJECT_ROOT / ".cache" / "tiny-qwen3"
TINY_FORMAT_VERSION = 3  # bump when the tiny recipe changes, so stale caches are rebuilt
# The tiny model as shipped: TinyConfig's architecture and tokenizer after pretrain/ (keyed recall, copying, small
# arithmetic; pretrain/README.md). 'tiny' loads these; 'tiny-init' is the random init they started from.
TINY_WEIGHTS = PROJECT_ROOT / "weights" / "tiny-recall"
TINY_NAMES = ("tiny", "tiny-init")

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
    """The recipe of the embedded tiny model: seed, BPE vocabulary size, Qwen3 architecture sizes and the number
    of toy-world tasks in the tokenizer's training text."""
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
    lines += toyworld.corpus_text(cfg.corpus_tasks, seed=cfg.seed)
    # the test-time rehearsal texts, so their scaffolding compresses like the template's
    lines += [chat_format.MEMORY_HEAD, chat_format.MEMORY_TAIL, chat_format.ASSESS_PREFIX, chat_format.ASSESS_OK,
              chat_format.ASSESS_ERROR, chat_format.ASSESS_WRONG, "    assessment: ", "-> predicted"] * 50
    render = _renderer()
    for task in toyworld.load_tasks("train", limit=max(cfg.corpus_tasks // 4, 1), seed=cfg.seed):
        lines.append(render.apply_chat_template(toyworld.reference_messages(task), tools=task.tools,
                                                tokenize=False))
    return lines


def _entity_words() -> list[str]:
    return sorted(set(toyworld.NAMES + toyworld.ITEMS))


def build_tokenizer(cfg: TinyConfig):
    """Byte-level BPE whose merges may cross spaces and punctuation, so the constant scaffolding (the tool
    block, template text) compresses into few tokens, while digits and the toy world's entity names stay
    separate tokens: a 3M-parameter model then sees ~100-token chats instead of ~500 and can still copy
    names and do digit arithmetic. Lossless like any byte-level BPE."""

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


def tiny_recipe(cfg: TinyConfig) -> dict:
    """What identifies a tiny model's build: the format version and the TinyConfig (tiny_recipe.json)."""
    return {"version": TINY_FORMAT_VERSION, **asdict(cfg)}


def build_tiny(path: Path, cfg: TinyConfig | None = None) -> Path:
    """Write a deterministic tiny Qwen3 model + tokenizer to `path` (atomically: temp folder, then rename)."""

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
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()      # a first-use build must not put a progress bar before a CLI's error line
    try:
        model.save_pretrained(tmp)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(tmp)
    (tmp / "tiny_recipe.json").write_text(json.dumps(tiny_recipe(cfg), indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def ensure_tiny(path: Path = TINY_DIR, cfg: TinyConfig | None = None) -> Path:
    """The tiny model's folder, rebuilt (build_tiny) only when its recorded recipe differs from `cfg`'s."""
    cfg = cfg or TinyConfig()
    recipe = Path(path) / "tiny_recipe.json"
    want = tiny_recipe(cfg)
    if not recipe.exists() or json.loads(recipe.read_text()) != want:
        build_tiny(path, cfg)
    return Path(path)


def shipped_tiny(path: Path = TINY_WEIGHTS) -> Path:
    """The shipped tiny weights' folder; a clear error when they are missing or were made for another recipe
    (TinyConfig changed since: pretrain again, pretrain/run.py)."""
    meta = Path(path) / "pretrain.json"
    if not _is_hf_folder(Path(path)) or not meta.exists():
        raise PolicyLoadError(f"the tiny model's weights are missing from {str(path)!r} (a partial clone?); "
                              "restore them with `git checkout -- weights`, or use --model tiny-init (untrained)")
    want = tiny_recipe(TinyConfig())
    made = json.loads(meta.read_text()).get("tiny_recipe")
    if made != want:
        raise PolicyLoadError(f"the weights in {str(path)!r} were pretrained for tiny recipe {made}, but "
                              f"policy.TinyConfig is now {want}: pretrain them again (python -m pretrain.run) "
                              "or use --model tiny-init")
    return Path(path)


GGUF_CACHE_DIR = PROJECT_ROOT / ".cache" / "gguf"
GGUF_FORMAT_VERSION = 1  # bump when the conversion changes, so stale converted folders are rebuilt
GGUF_SOURCE_FILE = "gguf_source.json"      # written into each converted folder: where it came from
TEMPLATE_KWARGS_FILE = "chat_template_kwargs.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").exists() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def resolve_model_path(name: str) -> Path:
    """The HF folder to load for `name`: 'tiny' (the shipped pretrained weights), 'tiny-init' (the random init,
    built on first use), a local HF folder, or a .gguf file (or a folder holding one .gguf, with or without its
    tokenizer files), converted once into GGUF_CACHE_DIR."""
    if name == "tiny":
        return shipped_tiny()
    if name == "tiny-init":
        return ensure_tiny()
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and not path.is_file():
        raise PolicyLoadError(f"model file {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise PolicyLoadError(f"model path {str(path)!r} is a file but not a .gguf; pass a .gguf file, a local "
                                  "Hugging Face checkpoint folder or 'tiny'")
        return gguf_to_hf(path)
    if not path.is_dir():
        raise PolicyLoadError(f"model path {str(path)!r} does not exist or is not a folder; pass a local "
                              "Hugging Face checkpoint folder (config.json, weights, tokenizer), a .gguf file "
                              "or 'tiny'")
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not _is_hf_folder(path):
        if len(ggufs) > 1:
            raise PolicyLoadError(f"model folder {str(path)!r} holds {len(ggufs)} .gguf files "
                                  f"({', '.join(g.name for g in ggufs)}); pass the one to load as --model FILE")
        return gguf_to_hf(ggufs[0])
    missing = [f for f in ("config.json",) if not (path / f).exists()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("*.safetensors weights")
    if not any((path / f).exists() for f in HF_TOKENIZER_FILES):
        missing.append("tokenizer.json")
    if missing:
        raise PolicyLoadError(f"model folder {str(path)!r} is incomplete: missing {', '.join(missing)}")
    return path


def _gguf_source(gguf: Path) -> dict:
    """What a converted folder depends on: the file (path, size, mtime), the folder's own tokenizer files if
    it has any (they are used instead of the GGUF's vocabulary), the converter (transformers version)."""

    def ident(p: Path):
        st = p.stat()
        return {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    return {"version": GGUF_FORMAT_VERSION, "transformers": transformers.__version__, "gguf": ident(gguf),
            "tokenizer": [ident(gguf.parent / f) for f in HF_TOKENIZER_FILES if (gguf.parent / f).exists()]}


def gguf_to_hf(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The cached HF folder converted from `gguf` (weights dequantized to float32, tokenizer, generation
    config), converting it first if the cache has no up-to-date copy. Checkpoints trained from it are then
    ordinary HF folders, and later loads skip the ~20 s conversion."""

    gguf = Path(gguf)
    source = _gguf_source(gguf)
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(cache_dir or GGUF_CACHE_DIR) / f"{gguf.stem}-{digest}"
    if (out / GGUF_SOURCE_FILE).exists():
        return out
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise PolicyLoadError(f"loading a .gguf model needs the {' and '.join(missing)} package"
                              f"{'s' if len(missing) > 1 else ''}: pip install {' '.join(missing)} "
                              "(versions in requirements.txt)")

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")   # built aside, then renamed into place whole
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True))
        if source["tokenizer"]:
            tok = AutoTokenizer.from_pretrained(gguf.parent, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except Exception as exc:
        raise PolicyLoadError(f"cannot read GGUF file {str(gguf)!r} (corrupt, truncated or an unsupported "
                              f"architecture?): {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from exc
    # save_pretrained refuses a model loaded through the GGUF quantizer: move its (already dense) tensors
    # into a plain model of the same config, built on the meta device so no second copy is allocated
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / GGUF_SOURCE_FILE).write_text(json.dumps(source, indent=1))
    try:
        os.replace(tmp, out)   # `out` is only ever published whole, so an existing one is complete
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)   # another process (a torchrun rank) published it first
        if not (out / GGUF_SOURCE_FILE).exists():
            raise
    return out


def read_chat_template(path: str | Path) -> str:
    """The text of a --chat-template file; PolicyLoadError if it cannot be read."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyLoadError(f"cannot read chat template file {str(path)!r}: not UTF-8 text (byte "
                              f"{exc.start}: {exc.reason}); save it as UTF-8") from exc
    except OSError as exc:
        raise PolicyLoadError(f"cannot read chat template file {str(path)!r}: {exc.strerror or exc}") from exc
    if not text.strip():
        raise PolicyLoadError(f"chat template file {str(path)!r} is empty")
    return text


def parse_template_kwargs(text: str) -> dict:
    """Extra chat-template variables (--chat-template-kwargs): a JSON object; ValueError (one line) otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"expected a JSON object like '{{\"enable_thinking\": false}}', got {text!r} "
                         f"({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object (in braces), got a JSON {type(value).__name__}: {text!r}")
    clash = sorted(set(value) & APPLY_CHAT_TEMPLATE_ARGUMENTS)
    if clash:
        raise ValueError(f"{', '.join(clash)} {'is an argument' if len(clash) == 1 else 'are arguments'} of "
                         "apply_chat_template that the engine sets itself, not a template variable; drop "
                         f"{'it' if len(clash) == 1 else 'them'}")
    return value


# apply_chat_template's own parameters: passed as template variables they would collide (TypeError) or change
# what the engine gets back
APPLY_CHAT_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def saved_template_kwargs(name: str | Path) -> dict:
    """The chat-template variables a checkpoint was trained with (TEMPLATE_KWARGS_FILE), {} if none."""
    path = resolve_model_path(str(name)) / TEMPLATE_KWARGS_FILE
    if not path.exists():
        return {}
    try:
        return parse_template_kwargs(path.read_text())
    except ValueError as exc:
        raise PolicyLoadError(f"{str(path)!r} is corrupt: {exc}") from exc


def template_kwargs_for(name: str | Path, explicit: dict | None) -> dict:
    """The chat-template variables to use with model `name`: an explicit flag wins, else the checkpoint's."""
    return dict(explicit) if explicit is not None else saved_template_kwargs(name)


def save_template_kwargs(folder: Path, kwargs: dict):
    """Store the variables next to the tokenizer, so loading the folder reproduces the rendering."""
    if kwargs:
        (Path(folder) / TEMPLATE_KWARGS_FILE).write_text(json.dumps(kwargs, indent=1))


def load_tokenizer(path: str | Path, chat_template: str | Path | None = None):
    """The folder's tokenizer; `chat_template` (a file) replaces its chat template (saved with it after)."""

    path = resolve_model_path(str(path))
    template = read_chat_template(chat_template) if chat_template else None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # a corrupt tokenizer file surfaces as many exception types
        raise PolicyLoadError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc
    if template is not None:
        tok.chat_template = template
    if not tok.chat_template:
        raise PolicyLoadError(f"the tokenizer in {str(path)!r} has no chat template; the rollout engine renders "
                              "turns with the model's own template (add one to tokenizer_config.json, or pass "
                              f"--chat-template {TOOLS_TEMPLATE_PATH.relative_to(PROJECT_ROOT)})")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def default_attn_implementation(device: torch.device) -> str:
    """flash_attention_2 on CUDA when flash_attn is installed, else sdpa."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_policy(name: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                attn_implementation: str | None = None, chat_template: str | Path | None = None):
    """(model, tokenizer) from 'tiny', a local HF folder or a .gguf; clear PolicyLoadError on anything broken.

    chat_template: a file whose text replaces the tokenizer's chat template (e.g. TOOLS_TEMPLATE_PATH)."""

    if chat_template:
        read_chat_template(chat_template)   # a bad file fails before any model is built, converted or loaded
    path = resolve_model_path(str(name))
    tok = load_tokenizer(path, chat_template)
    device = torch.device(device)
    attn = attn_implementation or default_attn_implementation(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    except Exception as exc:
        raise PolicyLoadError(f"cannot load model weights from {str(path)!r}: {type(exc).__name__}: {exc}. "
                              "The folder may be corrupt or half-written; re-save it or pick another "
                              "checkpoint") from exc
    return model.to(device), tok
