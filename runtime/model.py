"""Model loading, and the built-in model that lets everything run offline.

Any local mlx-lm model directory loads through `mlx_lm.load`. With no model named, a small
Llama-architecture model with seeded random weights and a byte-level tokenizer is written to a
cache directory once and then loaded through the very same path. Its output is noise: it exists
so the server, the tests and the benchmarks run without a network or a model hub. Its output
layer is biased so it only emits printable ASCII (bytes 32..126), and never EOS unless built
with `allow_eos=True`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs

from runtime.cachedir import default_cache_dir

BUILTIN_FORMAT_VERSION = 1
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
BOS_ID, EOS_ID = 256, 257
PRINTABLE = range(32, 127)
DEFAULT_CONTEXT_LENGTH = 4096

# Residual dimension 0 carries a constant (see _bias_output); these set its size and the bias.
_RESIDUAL_CONST = 8.0
_BLOCK_BIAS = 1000.0  # lm_head weight on dim 0 for tokens the model must never emit
# With allow_eos: EOS becomes the greedy pick within 48 tokens for about a third of prompts
# (measured over random printable prompts; first hits spread over steps 1..44).
_EOS_BIAS = 0.1

BUILTIN_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "vocab_size": 258,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelBundle:
    """A loaded model with what the runtime needs to know about it."""

    model: Any
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    name: str
    context_length: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None

    @property
    def vocab_size(self) -> int:
        """The token ids the model has logits for (its config's `vocab_size`)."""
        size = getattr(getattr(self.model, "args", None), "vocab_size", None)
        return int(size) if size else len(self.tokenizer.vocab)


def make_builtin_model(
    cache_dir: Path | None = None, *, allow_eos: bool = False, seed: int = 0
) -> Path:
    """Write the built-in model directory (once) and return its path.

    The directory name is derived from the config, seed and format version, and the directory is
    written under a temporary name and renamed into place, so concurrent callers are safe.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = json.dumps(
        {
            "config": BUILTIN_CONFIG,
            "seed": seed,
            "allow_eos": allow_eos,
            "version": BUILTIN_FORMAT_VERSION,
            "bias": [_RESIDUAL_CONST, _BLOCK_BIAS, _EOS_BIAS],
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = cache_dir / f"builtin-llama-{digest}"
    if (path / "config.json").exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-builtin-", dir=cache_dir))
    try:
        _write_model_dir(tmp, allow_eos=allow_eos, seed=seed)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").exists():
                raise  # not a lost race: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_model(path: str | Path | None = None) -> ModelBundle:
    """Load a local mlx-lm model directory; with None, the built-in model."""
    path = Path(path) if path is not None else make_builtin_model()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not an mlx-lm model directory (no config.json); "
            "pass a local model directory or no model to use the built-in one"
        )
    model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    context_length = _context_length(config)
    # The server checks a prompt against the context itself (a 400 naming it); the tokenizer's
    # own check only logged a warning for every prompt past it. No limit there (transformers'
    # own "no limit" value); nothing here asks the tokenizer to truncate.
    if hasattr(tokenizer, "_tokenizer") and hasattr(tokenizer._tokenizer, "model_max_length"):
        tokenizer._tokenizer.model_max_length = int(1e30)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ModelBundle(
        model=model,
        tokenizer=tokenizer,
        path=path,
        name=path.name,
        context_length=context_length,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        bos_token_id=bos,
    )


def _context_length(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT_LENGTH


def _write_model_dir(path: Path, *, allow_eos: bool, seed: int) -> None:
    weights = _make_weights(seed, allow_eos=allow_eos)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(BUILTIN_CONFIG, indent=2))
    _write_tokenizer(path)
    (path / "README.md").write_text(
        "fairtick built-in model: seeded random weights, byte-level tokenizer.\n"
        "Its output is noise; it exists so everything runs offline.\n"
    )


def _make_weights(seed: int, *, allow_eos: bool) -> dict[str, mx.array]:
    args = ModelArgs.from_dict(BUILTIN_CONFIG)
    model = Model(args)
    params = dict(tree_flatten(model.parameters()))
    key = mx.random.key(seed)
    weights: dict[str, mx.array] = {}
    for name in sorted(params):
        key, sub = mx.random.split(key)
        shape = params[name].shape
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(shape, dtype=mx.float32)
        elif name.endswith("embed_tokens.weight"):
            weights[name] = mx.random.normal(shape, key=sub)
        else:
            # Linear (out, in): keep activations near unit scale.
            weights[name] = mx.random.normal(shape, key=sub) * shape[1] ** -0.5
    _bias_output(weights, args, allow_eos=allow_eos)
    mx.eval(weights)
    return weights


def _bias_output(weights: dict[str, mx.array], args: ModelArgs, *, allow_eos: bool) -> None:
    # mlx-lm's Llama has no lm_head bias. Instead, residual dimension 0 holds a constant: every
    # embedding has C there, no layer writes to it and no layer reads it (its norm weight is 0),
    # so after the final RMSNorm h[0] > 0 at every position and lm_head column 0 acts as a bias.
    hidden = args.hidden_size
    emb = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = emb * (mx.arange(hidden) != 0) + _RESIDUAL_CONST * (
        mx.arange(hidden) == 0
    )
    for i in range(args.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w = weights[prefix + name]
            weights[prefix + name] = w * (mx.arange(hidden) != 0)[:, None]
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            weights[prefix + name] = (mx.arange(hidden) != 0).astype(mx.float32)
    bias = [-_BLOCK_BIAS] * args.vocab_size
    for token in PRINTABLE:
        bias[token] = 0.0
    if allow_eos:
        bias[EOS_ID] = _EOS_BIAS
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate([mx.array(bias)[:, None], head[:, 1:]], axis=1)


def bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map, which the ByteLevel pieces expect.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _write_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    # Token id == byte value, so mlx-lm picks its BPE streaming detokenizer.
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID and tok.token_to_id(EOS_TOKEN) == EOS_ID
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": BUILTIN_CONFIG["max_position_embeddings"],
        "chat_template": _CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
