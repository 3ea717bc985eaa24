"""The model the flags describe: the shape flags (Megatron-LM's names) against TransformerConfig's
fields, filled from a --load checkpoint's recorded model or the --model preset (`resolve_model`,
which refuses flags that contradict the checkpoint), and the config the trainer builds
(`model_config`)."""

from __future__ import annotations

import dataclasses
import difflib
import re

from megafp8.models.config import PRESETS, TransformerConfig
from megafp8.training import checkpointing

from .flags import ArgumentsError, flag_names

# (flag dest, TransformerConfig field, flag value -> field value, field value -> flag value)
_SHAPE = [
    ("num_layers", "num_layers", None, None),
    ("hidden_size", "hidden_size", None, None),
    ("num_attention_heads", "num_attention_heads", None, None),
    ("num_query_groups", "num_kv_heads", None, None),
    ("ffn_hidden_size", "ffn_hidden_size", None, None),
    ("max_position_embeddings", "max_position_embeddings", None, None),
    (
        "position_embedding_type",
        "position_embedding",
        {"learned_absolute": "learned", "rope": "rope"}.get,
        {"learned": "learned_absolute", "rope": "rope"}.get,
    ),
    (
        "normalization",
        "normalization",
        {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get,
        {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get,
    ),
    ("norm_epsilon", "norm_epsilon", None, None),
    ("swiglu", "activation", None, lambda activation: activation == "swiglu"),
    ("disable_bias_linear", "bias", lambda flag: not flag, lambda bias: not bias),
    (
        "untie_embeddings_and_output_weights",
        "tie_embeddings",
        lambda flag: not flag,
        lambda tied: not tied,
    ),
    ("init_method_std", "init_method_std", None, None),
    ("hidden_dropout", "hidden_dropout", None, None),
    ("attention_dropout", "attention_dropout", None, None),
    ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by", None, None),
    ("rotary_base", "rope_theta", None, None),
]
# TransformerConfig's error messages name fields; say which flag sets each.
_FIELD_FLAGS = {field: "--" + dest.replace("_", "-") for dest, field, _, _ in _SHAPE}
_FIELD_FLAGS.update(
    kv_heads="--num-query-groups",
    ffn_size="--ffn-hidden-size",
    head_dim="--hidden-size / --num-attention-heads",
    tp_size="--tensor-model-parallel-size",
)


# Fields a run may set otherwise than the checkpoint it loads, since no weight depends on them:
# the vocabulary is the tokenizer's (the trainer checks it against the checkpoint's), dropout is
# a training choice. (RoPE's position range too: its tables are computed, see _check_saved_model.)
_FREE_FIELDS = ("vocab_size", "hidden_dropout", "attention_dropout")
_SWITCHES = ("swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights")


def _sizes(fields: dict, field: str):
    """A field's value with the defaulted sizes spelled out (None key/value heads = one per head)."""
    if field == "num_kv_heads":
        return fields[field] or fields["num_attention_heads"]
    if field == "ffn_hidden_size":
        return fields[field] or 4 * fields["hidden_size"]
    return fields[field]


def _shown(value) -> str:
    return str(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)


def _check_saved_model(args, saved: TransformerConfig, checkpoint) -> None:
    """The shape flags given and the --model preset must describe the model the --load checkpoint
    recorded (they may be left out: that model is the base); a contradiction is an error naming
    both values, since the weights loaded have the checkpoint's shape."""
    names = [f.name for f in dataclasses.fields(TransformerConfig)]
    have = {name: getattr(saved, name) for name in names}
    asked, source = dict(have), {}
    if args.model is not None:
        for name in names:
            asked[name], source[name] = getattr(PRESETS[args.model], name), None
    for dest, field, to_field, _ in _SHAPE:
        value = getattr(args, dest)
        if value is not None:  # given: the switches are only ever True here
            asked[field] = "swiglu" if dest == "swiglu" else to_field(value) if to_field else value
            source[field] = flag_names(dest) if dest in _SWITCHES else f"{flag_names(dest)} {value}"
    free = _FREE_FIELDS + (
        ("max_position_embeddings",) if saved.position_embedding == "rope" else ()
    )
    wrong = [
        name for name in source if name not in free and _sizes(asked, name) != _sizes(have, name)
    ]
    if not wrong:
        return
    flags = [source[name] for name in wrong if source[name] is not None]
    from_preset = [name for name in wrong if source[name] is None]
    if from_preset:
        flags.append(
            f"--model {args.model} ({', '.join(f'{n} {_shown(_sizes(asked, n))}' for n in from_preset)})"
        )
    theirs = ", ".join(f"{name} {_shown(_sizes(have, name))}" for name in wrong)
    one = len(flags) == 1
    said = flags[0] if one else f"{', '.join(flags[:-1])} and {flags[-1]}"
    raise ArgumentsError(
        f"{said} {'contradicts' if one else 'contradict'} the checkpoint's model in {checkpoint} ({theirs}): "
        f"drop {'it' if one else 'them'} to train on the saved model, or --save to a new folder without "
        f"--load {args.load} to train another"
    )


def resolve_model(args, given) -> TransformerConfig | None:
    """Fill the shape flags not given from the model the --load checkpoint recorded, else from
    the --model preset (or TransformerConfig's defaults), so that args alone describe the model.
    Returns the checkpoint's model config (None without one)."""
    if args.model is not None and args.model not in PRESETS:
        close = difflib.get_close_matches(args.model, list(PRESETS), n=1)
        raise ArgumentsError(
            f"--model {args.model!r} is not a preset"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f"; presets: {', '.join(PRESETS)}"
        )
    # A first run of `--save X --load X` finds no checkpoint: then the flags describe the model.
    checkpoint, saved = checkpointing.latest_model_config(args.load) or (None, None)
    if saved is not None:
        _check_saved_model(args, saved, checkpoint)
        base = {f.name: getattr(saved, f.name) for f in dataclasses.fields(TransformerConfig)}
    elif args.model is not None:
        base = {
            f.name: getattr(PRESETS[args.model], f.name)
            for f in dataclasses.fields(TransformerConfig)
        }
    else:
        base = {
            f.name: f.default
            for f in dataclasses.fields(TransformerConfig)
            if f.default is not dataclasses.MISSING
        }
        missing = [
            d
            for d in ("num_layers", "hidden_size", "num_attention_heads")
            if getattr(args, d) is None
        ]
        if missing:
            raise ArgumentsError(
                f"no model: give --model (one of {', '.join(PRESETS)}) or the shape "
                f"flags; missing {', '.join(flag_names(d) for d in missing)}"
            )
    for dest, field, _, from_field in _SHAPE:
        if getattr(args, dest) is None and field in base:
            value = base[field]
            setattr(args, dest, from_field(value) if from_field and value is not None else value)

    if args.seq_length is None:
        if args.max_position_embeddings is None:
            raise ArgumentsError("no sequence length: give --seq-length")
        args.seq_length = args.max_position_embeddings
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (
        args.position_embedding_type == "learned_absolute"
        and args.seq_length > args.max_position_embeddings
    ):
        source = (
            ""
            if "max_position_embeddings" in given
            else f" (the checkpoint's model in {checkpoint})"
            if saved is not None
            else f" (from --model {args.model})"
            if args.model
            else ""
        )
        raise ArgumentsError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}{source}: learned positions have no row past it; lower --seq-length"
            + ("" if saved is not None else " or raise --max-position-embeddings")
        )
    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentsError(
            "--group-query-attention needs --num-query-groups (the number of key/value heads)"
        )

    try:  # the shape's own rules (heads divide hidden, tp divides heads ...), before any GPU is touched
        model_config(args, 2, saved).validate_tensor_parallel(args.tensor_model_parallel_size)
    except ValueError as error:
        message = str(error)
        named = [
            f"{field} is {flag}"
            for field, flag in _FIELD_FLAGS.items()
            if re.search(rf"\b{field}\b", message)
        ]
        preset_note = (
            f" (the checkpoint's model in {checkpoint})"
            if saved is not None
            else f" (--model {args.model})"
            if args.model
            else ""
        )
        raise ArgumentsError(
            f"invalid model shape{preset_note}: {message}"
            + (f" [{'; '.join(named)}]" if named else "")
        ) from None
    return saved


def model_config(
    args, vocab_size: int, saved: TransformerConfig | None = None
) -> TransformerConfig:
    """The model of `args` for the tokenizer's `vocab_size`: the shape flags applied to `saved`
    (the model a --load checkpoint recorded, `checkpointing.latest_model_config`) if given, else
    to the --model preset, so that fields without a flag (rope_scaling, erf GELU) are kept. With
    RoPE the position range grows to cover --seq-length: rotary tables are computed, not learned."""
    fields = {
        field: (to_field(getattr(args, dest)) if to_field else getattr(args, dest))
        for dest, field, to_field, _ in _SHAPE
        if dest != "swiglu"
    }
    base = saved if saved is not None else PRESETS.get(args.model)
    plain = base.activation if base is not None and base.activation != "swiglu" else "gelu_tanh"
    fields["activation"] = "swiglu" if args.swiglu else plain
    if fields["position_embedding"] == "rope":
        fields["max_position_embeddings"] = max(fields["max_position_embeddings"], args.seq_length)
    fields["vocab_size"] = vocab_size
    return base.replace(**fields) if base is not None else TransformerConfig(**fields)
