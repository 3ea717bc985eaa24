"""tools/convert_checkpoint.py: megafp8 checkpoints saved by tp = 2 FP8 runs become Hugging Face
models with the same logits; Hugging Face -> megafp8 -> Hugging Face is bitwise; a converted
checkpoint loads under another tensor-parallel size; tokenizers travel; errors say what is wrong.
Everything runs on the CPU in fp32 (the FP8 state of the runs is dropped); nothing is downloaded."""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megafp8.data.tokenizers import build_tokenizer
from megafp8.models import hf_mapping, preset
from megafp8.models.transformer import TransformerLM
from megafp8.parallel import ParallelGroups
from megafp8.parallel.data_parallel import GradientBuffer
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from megafp8.fp8 import CurrentScaling, DelayedScaling, fp8_autocast
from megafp8.training import arguments, checkpointing
from megafp8.training.optimizer import MixedPrecisionAdamW
from megafp8.training.trainer import pretrain

from ..data.corpora import train_tiny_bpe, train_tiny_sentencepiece
from ..fp8.helpers import rel_err
from ..multiprocess import run_on_ranks
from .load import load_tool

REPO = Path(__file__).resolve().parents[2]

convert = load_tool("convert_checkpoint")
# load_checkpoint in this process (tp = 1, no process group) is DCP's single-process mode.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MODELS = ["gpt-tiny", "llama-tiny"]  # llama-tiny: 4 heads sharing 2 key/value heads (GQA)
RECIPES = {"gpt-tiny": DelayedScaling(amax_history_len=4), "llama-tiny": CurrentScaling()}
SEQ = 32
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2\n",
    "naïve éclair, 数据 and 模型 — 12345",
]


def tokens(vocab, seed=3, shape=(2, 24)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def run_args(name, tp=2):
    """The arguments a `megafp8-train` run of the preset records in its checkpoints."""
    args = arguments.parse_args(
        [
            "--model",
            name,
            "--mock-data",
            "--train-iters",
            "3",
            "--micro-batch-size",
            "2",
            "--lr",
            "1e-2",
            "--seq-length",
            str(SEQ),
            "--fp8-format",
            "hybrid",
            "--tensor-model-parallel-size",
            str(tp),
        ]
    )
    return arguments.args_to_dict(args)


def train_and_save_body(rank, world_size, folders):
    """A few FP8 training steps of each model at tp = 2, then a checkpoint (gpt-tiny, under
    delayed scaling, with FP8 primary weights, which the checkpoint holds as their values); and
    a bf16 gpt-tiny (bf16 weights, fp32 masters), whose masters it returns."""
    groups = ParallelGroups(world_size)
    for name, folder in folders.items():
        bf16 = name.endswith("-bf16")
        name = name.removesuffix("-bf16")
        config = preset(name)
        model = TransformerLM(
            config,
            tp_group=groups.tp_group,
            seed=0,
            dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        buffer = GradientBuffer(model.parameters(), groups.dp_group, bucket_size=5_000)
        optimizer = MixedPrecisionAdamW(
            model.named_parameters(),
            buffer,
            lr=1e-2,
            weight_decay=0.1,
            model_parallel_group=groups.model_parallel_group,
            tp_group=groups.tp_group,
            dp_group=groups.dp_group,
            fp8_linears=model.fp8_linears(),
        )
        if isinstance(RECIPES[name], DelayedScaling) and not bf16:
            optimizer.make_weights_fp8(
                model.fp8_linears(), amax_reduction_group=groups.amax_reduction_group
            )
        for step in range(3):
            buffer.zero()
            batch = tokens(config.vocab_size, seed=100 + step, shape=(2, SEQ + 1))
            with fp8_autocast(
                recipe=RECIPES[name], amax_reduction_group=groups.amax_reduction_group
            ):
                model(batch[:, :-1], batch[:, 1:]).float().mean().backward()
            buffer.finish()
            optimizer.step()
        checkpointing.save_checkpoint(
            folder,
            3,
            model,
            optimizer,
            groups=groups,
            train_state={"iteration": 3},
            args=run_args(name),
            model_config=config,
        )


def load_tp2_body(rank, world_size, folders):
    """Each converted checkpoint under tp = 2 with an optimizer: this rank's logits, whether the
    optimizer's masters were reset from the weights, and that a step runs."""
    groups = ParallelGroups(world_size)
    out = {}
    for name, folder in folders.items():
        config = preset(name)
        # another init: all must be loaded
        model = TransformerLM(config, tp_group=groups.tp_group, seed=1)
        buffer = GradientBuffer(model.parameters(), groups.dp_group, bucket_size=5_000)
        optimizer = MixedPrecisionAdamW(
            model.named_parameters(),
            buffer,
            lr=1e-3,
            model_parallel_group=groups.model_parallel_group,
            tp_group=groups.tp_group,
            dp_group=groups.dp_group,
        )
        state = checkpointing.load_checkpoint(
            folder, model, optimizer, groups=groups, load_optimizer=False, load_rng=False
        )
        with torch.no_grad():
            logits = model.eval()(tokens(config.vocab_size))
        masters = optimizer.state_for_checkpoint()
        reset = all(
            torch.equal(masters[n]["master"], p.detach().float())
            for n, p in model.named_parameters()
        )
        buffer.zero()
        batch = tokens(config.vocab_size, seed=200, shape=(2, SEQ + 1))
        model.train()(batch[:, :-1], batch[:, 1:]).mean().backward()
        buffer.finish()
        applied, _ = optimizer.step()
        out[name] = logits, reset, applied, state
    return out


def megafp8_logits(folder, name, inputs=None):
    """Logits of the checkpoint loaded into one process (tp = 1), padded vocabulary sliced off."""
    config = preset(name)
    model = TransformerLM(config)
    checkpointing.load_checkpoint(folder, model, None, groups=None, load_rng=False)
    with torch.no_grad():
        return model.eval()(tokens(config.vocab_size) if inputs is None else inputs)[
            ..., : config.vocab_size
        ]


def hf_weights(folder):
    """Every tensor of a Hugging Face folder, sharded or not."""
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for file in files:
        out.update(load_file(folder / file))
    return out


def assert_same_weights(a, b):
    wa, wb = hf_weights(a), hf_weights(b)
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert wa[name].dtype == wb[name].dtype and torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gpt-tiny and llama-tiny trained 3 FP8 steps at tp = 2 and saved; and converted to HF."""
    root = tmp_path_factory.mktemp("trained")
    folders = {name: str(root / name) for name in MODELS + ["gpt-tiny-bf16"]}
    run_on_ranks(train_and_save_body, 2, folders)
    for name in MODELS:  # --mock-data runs: no tokenizer
        convert.to_hf(folders[name], root / f"{name}-hf", progress=False, no_tokenizer=True)
    return root


@pytest.mark.parametrize("name", MODELS)
def test_tp2_fp8_checkpoint_to_hf_gives_the_same_logits(trained, name):
    hf_dir = trained / f"{name}-hf"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf) is (GPT2LMHeadModel if name.startswith("gpt") else LlamaForCausalLM)
    config = preset(name)
    if name == "llama-tiny":
        assert hf.config.num_key_value_heads == 2 and not hf.config.tie_word_embeddings
    assert hf.config.vocab_size == config.vocab_size  # the padding rows are gone
    expected = megafp8_logits(trained / name, name)
    inputs = tokens(config.vocab_size)
    with torch.no_grad():
        got = hf(inputs).logits
    assert rel_err(got, expected) < 1e-4
    generated = hf.generate(inputs[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 12)
    # Greedy decoding's first token is megafp8's most likely next token.
    assert torch.equal(
        generated[:, 8], megafp8_logits(trained / name, name, inputs[:, :8])[:, -1].argmax(-1)
    )


def test_into_another_layout_and_back(trained, tmp_path):
    """HF -> megafp8 (recorded for tp = 2) loads under tp = 2 with the logits of the trained model
    and a fresh optimizer state; converted back it is bitwise the same HF model."""
    folders = {}
    for name in MODELS:
        with pytest.warns(UserWarning, match="no tokenizer files"):
            folders[name] = str(
                convert.from_hf(
                    trained / f"{name}-hf",
                    tmp_path / name,
                    tensor_model_parallel_size=2,
                    progress=False,
                ).parent
            )
        saved = json.loads((tmp_path / name / "iter_0000000" / "megafp8.json").read_text())
        assert saved["args"]["tensor_model_parallel_size"] == 2 and saved["iteration"] == 0
    results = run_on_ranks(load_tp2_body, 2, folders)
    for name in MODELS:
        config = preset(name)
        logits = torch.cat([results[rank][name][0] for rank in range(2)], dim=-1)[
            ..., : config.vocab_size
        ]
        assert rel_err(logits, megafp8_logits(trained / name, name)) < 1e-5
        _, reset, applied, state = results[0][name]
        assert reset and applied and state == convert.TRAIN_STATE
        convert.to_hf(tmp_path / name, tmp_path / f"{name}-hf", progress=False, no_tokenizer=True)
        assert_same_weights(trained / f"{name}-hf", tmp_path / f"{name}-hf")


def randomize(model, dtype=torch.float32):
    """Every parameter random (HF initialises biases to 0 and norms to 1, hiding mapping errors)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.to(dtype).eval()


def small_gpt2(**overrides):
    return GPT2LMHeadModel(
        GPT2Config(
            **{
                "vocab_size": 400,
                "n_positions": 64,
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "bos_token_id": 0,
                "eos_token_id": 0,
                **overrides,
            }
        )
    )


def small_llama(**overrides):
    return LlamaForCausalLM(
        LlamaConfig(
            **{
                "vocab_size": 400,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 64,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
                **overrides,
            }
        )
    )


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

ROUND_TRIPS = {
    "gpt2": lambda: small_gpt2(),
    "gpt2-untied-erf-gelu": lambda: small_gpt2(
        tie_word_embeddings=False, activation_function="gelu"
    ),
    "llama-gqa": lambda: small_llama(),
    "llama-tied-bias-llama3-rope": lambda: small_llama(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ROUND_TRIPS)
def test_hf_to_megafp8_to_hf_is_bitwise(tmp_path, kind, dtype):
    hf = randomize(ROUND_TRIPS[kind](), dtype)
    # sharded, with an index, on the way in
    hf.save_pretrained(tmp_path / "a", max_shard_size="40KB")
    with pytest.warns(UserWarning) as caught:
        convert.from_hf(tmp_path / "a", tmp_path / "ckpt", progress=False)
    # and nothing about the model is lost
    assert all("no tokenizer files" in str(w.message) for w in caught)
    convert.main(
        [
            "--direction",
            "to-hf",
            "--load",
            str(tmp_path / "ckpt"),
            "--output",
            str(tmp_path / "b"),
            "--max-shard-size",
            "100KB",
            "--no-progress",
            "--no-tokenizer",
        ]
    )
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()  # sharded on the way out
    assert_same_weights(tmp_path / "a", tmp_path / "b")
    # Both folders load as the same model (from_pretrained, not the model in memory: casting that
    # to bf16 also rounded its rotary frequencies).
    back, original = (AutoModelForCausalLM.from_pretrained(tmp_path / f).eval() for f in "ba")
    assert back.dtype == dtype and type(back) is type(hf)
    inputs = tokens(400, shape=(2, 16))
    with torch.no_grad():
        assert torch.equal(back(inputs).logits, original(inputs).logits)
    # ...and megafp8 computes what the HF model computes.
    config = hf_mapping.config_from_hf(hf.config)
    ours = TransformerLM(config, dtype=torch.float32)
    checkpointing.load_checkpoint(tmp_path / "ckpt", ours, None, groups=None, load_rng=False)
    with torch.no_grad():
        expected = hf.float()(inputs).logits
        assert rel_err(ours.eval()(inputs)[..., :400], expected) < (
            1e-4 if dtype == torch.float32 else 1e-2
        )


def test_fp32_export_of_a_bf16_run_takes_the_master_weights(trained, tmp_path):
    ckpt = trained / "gpt-tiny-bf16"
    masters = {
        "final_norm.weight": torch.empty(64),
        "layers.1.mlp.fc1.weight": torch.empty(256, 64),
    }
    dcp.load(
        {f"optimizer/{n}/master": t for n, t in masters.items()},
        checkpoint_id=str(ckpt / "iter_0000003"),
        no_dist=True,
    )
    convert.to_hf(ckpt, tmp_path / "bf16", progress=False, no_tokenizer=True)
    convert.to_hf(
        ckpt / "iter_0000003", tmp_path / "fp32", dtype="fp32", progress=False, no_tokenizer=True
    )
    bf16, fp32 = hf_weights(tmp_path / "bf16"), hf_weights(tmp_path / "fp32")
    assert bf16["transformer.ln_f.weight"].dtype == torch.bfloat16
    assert torch.equal(fp32["transformer.ln_f.weight"], masters["final_norm.weight"])
    assert torch.equal(
        fp32["transformer.h.1.mlp.c_fc.weight"], masters["layers.1.mlp.fc1.weight"].t()
    )
    # not the bf16 weights
    for name in (
        "transformer.ln_f.weight",
        "transformer.h.1.mlp.c_fc.weight",
    ):
        assert not torch.equal(fp32[name], bf16[name].float())
        assert torch.equal(fp32[name].bfloat16(), bf16[name])
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"


def test_pytorch_bin_with_old_gpt2_names(tmp_path):
    """pytorch_model.bin files, and GPT-2's original names (no "transformer." prefix, causal-mask
    buffers stored as weights), as the first GPT-2 uploads have them."""
    hf = randomize(small_gpt2())
    hf.save_pretrained(tmp_path / "new")
    (tmp_path / "old").mkdir()
    shutil.copy(tmp_path / "new" / "config.json", tmp_path / "old")
    old = {
        name.removeprefix("transformer."): t
        for name, t in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    old.update({f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64) for i in range(2)})
    torch.save(old, tmp_path / "old" / "pytorch_model.bin")
    with pytest.warns(UserWarning, match="no tokenizer"):
        convert.from_hf(tmp_path / "old", tmp_path / "ckpt", progress=False)
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out", progress=False, no_tokenizer=True)
    assert_same_weights(tmp_path / "new", tmp_path / "out")


# ---- tokenizers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A tiny byte-level BPE (tokenizer.json and vocab.json + merges.txt) and a SentencePiece model."""
    out = tmp_path_factory.mktemp("tokenizers")
    (out / "bpe").mkdir()
    train_tiny_bpe(out / "bpe")
    train_tiny_sentencepiece(out / "spm")
    return {
        "HuggingFaceTokenizer": {"tokenizer_model": str(out / "bpe" / "tokenizer.json")},
        "GPT2BPETokenizer": {
            "vocab_file": str(out / "bpe" / "vocab.json"),
            "merge_file": str(out / "bpe" / "merges.txt"),
        },
        "SentencePieceTokenizer": {"tokenizer_model": str(out / "spm.model")},
    }


def checkpoint_with_tokenizer(tmp_path, tokenizer_args):
    """A megafp8 checkpoint (converted from a random HF GPT-2) whose run used `tokenizer_args`."""
    randomize(small_gpt2()).save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="no tokenizer files"):
        path = convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    info = json.loads((path / "megafp8.json").read_text())
    info["args"].update(tokenizer_args)
    (path / "megafp8.json").write_text(json.dumps(info))
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    "kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer"]
)
def test_the_runs_tokenizer_goes_with_the_model(tmp_path, tokenizer_files, kind, capsys):
    files = tokenizer_files[kind]
    ckpt = checkpoint_with_tokenizer(tmp_path, {"tokenizer_type": kind, **files})
    convert.main(
        [
            "--direction",
            "to-hf",
            "--load",
            str(ckpt),
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    # The code the tool prints loads the model and its tokenizer.
    hint = capsys.readouterr().err.split(f"wrote {tmp_path / 'out'}\nload it with transformers:\n")[
        1
    ]
    loaded = {}
    exec(textwrap.dedent(hint), loaded)
    ours = build_tokenizer(kind, **files)
    theirs = loaded["tokenizer"]
    assert loaded["model"].config.eos_token_id == ours.eod
    for text in TEXTS:
        assert theirs(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)
    assert theirs.eos_token_id == ours.eod
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eod
    if kind != "SentencePieceTokenizer":  # byte-level BPE decodes exactly
        assert theirs.decode(ours.tokenize(TEXTS[1])) == TEXTS[1]
    copies = {
        "HuggingFaceTokenizer": {"tokenizer_model": "tokenizer.json"},
        "GPT2BPETokenizer": {"vocab_file": "vocab.json", "merge_file": "merges.txt"},
        "SentencePieceTokenizer": {"tokenizer_model": "tokenizer.model"},
    }[kind]
    for key, name in copies.items():  # the run's own files, byte for byte
        assert (tmp_path / "out" / name).read_bytes() == Path(files[key]).read_bytes()


def test_without_a_tokenizer_no_hugging_face_folder_is_written_unless_asked(
    tmp_path, tokenizer_files, capsys
):
    ckpt = checkpoint_with_tokenizer(
        tmp_path,
        {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": str(tmp_path / "gone" / "tokenizer.json"),
        },
    )
    with pytest.raises(
        convert.ConversionError, match="gone/tokenizer.json.*--tokenizer-dir.*--no-tokenizer"
    ):
        convert.to_hf(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything was written
    convert.main(
        [
            "--direction",
            "to-hf",
            "--load",
            str(ckpt),
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
            "--no-tokenizer",
        ]
    )
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()
    hint = capsys.readouterr().err
    assert (
        "AutoModelForCausalLM.from_pretrained" in hint
        and "AutoTokenizer" not in hint.splitlines()[-1]
    )
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the model itself is complete
    # --tokenizer-dir supplies them.
    bpe = tokenizer_files["HuggingFaceTokenizer"]["tokenizer_model"].rsplit("/", 1)[0]
    convert.to_hf(ckpt, tmp_path / "out2", tokenizer_dir=bpe, progress=False)
    assert AutoTokenizer.from_pretrained(tmp_path / "out2")("the fox")["input_ids"]
    # A run on mock data had none to begin with.
    mock = checkpoint_with_tokenizer(tmp_path / "mock", {"tokenizer_type": None})
    with pytest.raises(convert.ConversionError, match="the run used no tokenizer"):
        convert.to_hf(mock, tmp_path / "out3", progress=False)


@pytest.mark.filterwarnings("ignore:.*has no FP8 scaling state")  # a converted checkpoint has none
def test_from_hf_points_the_run_at_the_hf_tokenizer_and_a_run_of_it_needs_no_shape_flags(
    tmp_path, tokenizer_files, capsys
):
    hf = randomize(small_llama())
    hf.save_pretrained(tmp_path / "hf")
    shutil.copy(tokenizer_files["HuggingFaceTokenizer"]["tokenizer_model"], tmp_path / "hf")
    path = convert.from_hf(
        tmp_path / "hf",
        tmp_path / "ckpt",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        progress=False,
    )
    saved = arguments.args_from_dict(json.loads((path / "megafp8.json").read_text())["args"])
    assert saved.tokenizer_type == "HuggingFaceTokenizer"
    assert saved.tokenizer_model == str((tmp_path / "hf" / "tokenizer.json").resolve())
    assert (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size) == (2, 3)
    config = hf_mapping.config_from_hf(hf.config)
    assert checkpointing.saved_model_config(path) == config
    hint = capsys.readouterr().err.split("continue training with:")[1]
    assert f"--load {tmp_path / 'ckpt'} --finetune --tokenizer-type HuggingFaceTokenizer" in hint
    assert "--num-layers" not in hint and "--tensor-model-parallel-size 2" in hint
    # The run the printed flags start (any layout: pp = 1 here) builds the converted model and loads it.
    trainer = pretrain(
        [
            "--load",
            str(tmp_path / "ckpt"),
            "--finetune",
            "--tokenizer-type",
            saved.tokenizer_type,
            "--tokenizer-model",
            saved.tokenizer_model,
            "--mock-data",
            "--train-iters",
            "1",
            "--micro-batch-size",
            "1",
            "--lr",
            "1e-3",
            "--eval-iters",
            "0",
        ]
    )
    assert trainer.config == config and trainer.last_checkpoint == path
    assert (trainer.args.num_layers, trainer.args.num_query_groups, trainer.args.seq_length) == (
        3,
        2,
        64,
    )
    # The checkpoint folder carries its tokenizer, as a training run's does.
    assert (tmp_path / "ckpt" / "tokenizer" / "tokenizer.json").read_bytes() == (
        tmp_path / "hf" / "tokenizer.json"
    ).read_bytes()
    # No optimizer state, no FP8 state, no RNG: a --finetune start.
    metadata = (
        torch.distributed.checkpoint.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    )
    assert all(k.startswith("model/") or k == "train" for k in metadata)


@pytest.mark.filterwarnings("ignore:.*has no FP8 scaling state")  # a converted checkpoint has none
@pytest.mark.parametrize(
    "kind,setting",
    [
        ("llama-tied-bias-llama3-rope", "rope_parameters"),
        ("gpt2-untied-erf-gelu", "activation_function"),
    ],
)
def test_settings_without_a_flag_survive_finetuning_and_conversion_back(tmp_path, kind, setting):
    """Llama 3.1's llama3 rope scaling and GPT-2's erf GELU have no training flag: HF -> megafp8 ->
    a run of --load --finetune without shape flags -> its checkpoint -> HF keeps them."""
    hf = randomize(ROUND_TRIPS[kind]())
    hf.save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="no tokenizer files"):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    trainer = pretrain(
        [
            "--load",
            str(tmp_path / "ckpt"),
            "--finetune",
            "--mock-data",
            "--train-iters",
            "2",
            "--micro-batch-size",
            "2",
            "--seq-length",
            str(SEQ),
            "--lr",
            "1e-3",
            "--eval-iters",
            "0",
            "--save",
            str(tmp_path / "run"),
        ]
    )
    assert [i for i, _ in trainer.history] == [1, 2]
    # vocabulary too: the mock data's is the model's
    assert trainer.config == hf_mapping.config_from_hf(hf.config)
    convert.to_hf(tmp_path / "run", tmp_path / "out", progress=False, no_tokenizer=True)
    original, back = (
        json.loads((tmp_path / folder / "config.json").read_text()) for folder in ("hf", "out")
    )
    assert back[setting] == original[setting]
    assert back[setting] == (LLAMA3_ROPE if setting == "rope_parameters" else "gelu")


def test_a_run_converted_from_another_folder_generates_text(tmp_path):
    """The quickstart's way, shrunk: relative paths everywhere, then to-hf run from elsewhere.
    The checkpoint folder holds the tokenizer, so the HF folder gets it and generates."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()

    def tool(*cmd, cwd=work):
        return subprocess.run([sys.executable, *cmd], cwd=cwd, check=True, capture_output=True)

    tool(str(REPO / "tools/make_sample_corpus.py"), "--output", "corpus", "--max-mb", "0.2")
    tool(
        str(REPO / "tools/train_tokenizer.py"),
        "--input",
        "corpus",
        "--type",
        "bpe",
        "--vocab-size",
        "512",
        "--output",
        "tok",
    )
    tool(
        str(REPO / "tools/preprocess_data.py"),
        "--input",
        "corpus",
        "--output-prefix",
        "ds",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        "tok",
        "--append-eod",
    )
    tool(
        "-m",
        "megafp8.train",
        "--model",
        "gpt-tiny",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "4",
        "--train-iters",
        "20",
        "--lr",
        "1e-2",
        "--data-path",
        "ds_text_document",
        "--split",
        "1",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        "tok",
        "--eval-iters",
        "0",
        "--save",
        "run",
    )
    assert (work / "run" / "tokenizer" / "tokenizer.json").read_bytes() == (
        work / "tok" / "tokenizer.json"
    ).read_bytes()
    recorded = json.loads((work / "run" / "iter_0000020" / "megafp8.json").read_text())["args"]
    assert recorded["tokenizer_model"] == str(work / "tok") and recorded["data_path"] == [
        str(work / "ds_text_document")
    ]
    (work / "tok").rename(tmp_path / "moved")  # even with the run's own tokenizer files gone
    tool(
        str(REPO / "tools/convert_checkpoint.py"),
        "--direction",
        "to-hf",
        "--load",
        "../work/run",
        "--output",
        "hf",
        "--no-progress",
        cwd=elsewhere,
    )
    tokenizer = AutoTokenizer.from_pretrained(elsewhere / "hf")
    model = AutoModelForCausalLM.from_pretrained(elsewhere / "hf")
    prompt = tokenizer("def main():", return_tensors="pt")
    assert prompt["input_ids"].shape[1] > 0
    out = model.generate(
        **prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(out[0]).startswith("def main():")


# ---- errors -------------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    randomize(small_gpt2()).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(
        convert.ConversionError,
        match="model_type 'mistral' is not supported; supported: gpt2 "
        r"\(GPT2LMHeadModel\), llama \(LlamaForCausalLM\)",
    ):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)


def test_config_that_does_not_match_the_weights(tmp_path):
    randomize(small_llama()).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(
        convert.ConversionError,
        match=r"config.json does not match the weights: "
        r"model.layers.0.self_attn.k_proj.weight is \[32, 64\] in the weights, config.json "
        r"implies \[64, 64\]",
    ):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)


def test_missing_shard(tmp_path):
    randomize(small_llama()).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    gone = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "hf" / gone).unlink()
    with pytest.raises(
        convert.ConversionError, match=f"lists {gone}, which is not in .*incomplete"
    ):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(folder, edit):
    """Rewrite folder's model.safetensors with `edit` applied to its {name: tensor}."""
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_weights_that_config_json_does_not_describe_are_refused(tmp_path):
    """Nothing is dropped: a tensor the conversion would not take is an error naming it; the
    buffers Hugging Face recomputes, and a stored copy of a tied output layer, are skipped."""
    randomize(small_gpt2()).save_pretrained(tmp_path / "gpt2")
    edit_config(tmp_path / "gpt2", n_layer=1)  # the weights hold two layers
    with pytest.raises(
        convert.ConversionError,
        match=r"config.json describes 1 layer, the weights hold layer\(s\) 1 "
        r"too \(transformer.h.1.attn.c_attn.bias, .* and 7 more\): converting would lose them",
    ):
        convert.from_hf(tmp_path / "gpt2", tmp_path / "ckpt", progress=False)

    randomize(small_llama()).save_pretrained(tmp_path / "llama")
    edit_weights(
        tmp_path / "llama",
        lambda w: w.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
    )
    with pytest.raises(
        convert.ConversionError,
        match=r"the weights are not a LlamaForCausalLM of config.json's "
        r"shape: they hold 1 tensor\(s\) it has not \(model.layers.0.self_attn.q_norm.weight\): "
        "converting would lose them",
    ):
        convert.from_hf(tmp_path / "llama", tmp_path / "ckpt", progress=False)

    # Missing ones are named too: whole layers, or single tensors.
    randomize(small_llama()).save_pretrained(tmp_path / "short")
    edit_config(tmp_path / "short", num_hidden_layers=4)
    with pytest.raises(
        convert.ConversionError,
        match=r"config.json describes 4 layers, the weights lack layer\(s\) 3: "
        r"model.layers.3.input_layernorm.weight, .* and 4 more$",
    ):
        convert.from_hf(tmp_path / "short", tmp_path / "ckpt", progress=False)
    edit_config(tmp_path / "short", num_hidden_layers=3)
    edit_weights(tmp_path / "short", lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        convert.ConversionError,
        match=r"the weights lack 1 tensor\(s\) of the LlamaForCausalLM "
        r"config.json describes: model.layers.1.mlp.up_proj.weight$",
    ):
        convert.from_hf(tmp_path / "short", tmp_path / "ckpt", progress=False)

    # Llama's rotary frequencies (recomputed from rope_theta) are skipped; the weights come back bitwise.
    hf = randomize(small_llama())
    hf.save_pretrained(tmp_path / "rope")
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(3)}
    edit_weights(tmp_path / "rope", lambda w: w.update(inv_freq))
    with pytest.warns(UserWarning, match="no tokenizer files"):
        convert.from_hf(tmp_path / "rope", tmp_path / "rope-ckpt", progress=False)
    convert.to_hf(tmp_path / "rope-ckpt", tmp_path / "rope-out", progress=False, no_tokenizer=True)
    back, original = hf_weights(tmp_path / "rope-out"), hf.state_dict()
    assert sorted(back) == sorted(original) and all(
        torch.equal(back[n], original[n]) for n in original
    )

    # A tied model's stored lm_head.weight: a copy of the embedding is skipped, anything else refused.
    randomize(small_gpt2()).save_pretrained(tmp_path / "tied")
    edit_weights(
        tmp_path / "tied",
        lambda w: w.update({"lm_head.weight": w["transformer.wte.weight"].clone()}),
    )
    with pytest.warns(UserWarning, match="no tokenizer files"):
        convert.from_hf(tmp_path / "tied", tmp_path / "tied-ckpt", progress=False)
    edit_weights(tmp_path / "tied", lambda w: w.update({"lm_head.weight": torch.randn(400, 64)}))
    with pytest.raises(
        convert.ConversionError,
        match="ties the output layer to the embedding .* but the weights' "
        "lm_head.weight differs from transformer.wte.weight: converting would lose it",
    ):
        convert.from_hf(tmp_path / "tied", tmp_path / "ckpt", progress=False)


def test_an_index_names_only_files_in_its_folder(tmp_path):
    randomize(small_llama()).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    # there, so only the name is wrong
    shutil.copy(tmp_path / "hf" / shard, tmp_path / "elsewhere.safetensors")
    for outside in ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors")):
        weight_map = {**index["weight_map"], "model.norm.weight": outside}
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(
            convert.ConversionError,
            match=f"names {re.escape(outside)}, outside .*: an index may "
            "only name files in its own folder",
        ):
            convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()


def truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def shard(folder, i):
    return sorted(folder.glob("model-*.safetensors"))[i]


BAD_INPUTS = {  # a GPT-2 folder (sharded, with an index) made bad, and the error
    "config.json not JSON": (
        lambda d: (d / "config.json").write_text("{"),
        "config.json: not a readable JSON file",
    ),
    "config.json a list": (
        lambda d: (d / "config.json").write_text("[]"),
        "config.json: holds JSON but not an object",
    ),
    "config.json n_layer a string": (
        lambda d: edit_config(d, n_layer="two"),
        r"config.json: not a valid GPT2Config \(.*'n_layer'",
    ),
    # config.json is read before the weights, which need not match here.
    "llama3 rope without factors": (
        lambda d: edit_config(
            d, model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}
        ),
        r"config.json: not a valid LlamaConfig \(.*factor",
    ),
    "index not JSON": (
        lambda d: truncate(d / "model.safetensors.index.json", 10),
        "model.safetensors.index.json: not a readable JSON file",
    ),
    "truncated safetensors": (
        lambda d: truncate(shard(d, 1), 1000),
        r"model-00002-of-\d+.safetensors: not a valid safetensors file, truncated or corrupt",
    ),
    "safetensors header": (
        lambda d: truncate(shard(d, 0), 4),
        r"model-00001-of-\d+.safetensors: not a valid",
    ),
    "layers beyond config.json's": (
        lambda d: edit_config(d, n_layer=1),
        r"config.json describes 1 layer, the weights hold layer\(s\) 1 too",
    ),
    "index outside its folder": (
        lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"transformer.wte.weight": "/etc/passwd"}})
        ),
        "names /etc/passwd, outside",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_hugging_face_folders_are_one_line_errors(tmp_path, capsys, case):
    tamper, message = BAD_INPUTS[case]
    randomize(small_gpt2()).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    tamper(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exit_info:
        convert.main(
            [
                "--direction",
                "from-hf",
                "--hf-dir",
                str(tmp_path / "hf"),
                "--save",
                str(tmp_path / "c"),
                "--no-progress",
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_unsupported_hf_settings_are_named(tmp_path):
    randomize(
        small_llama(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    ).save_pretrained(tmp_path / "hf")
    with pytest.raises(convert.ConversionError, match="rope type 'linear'"):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    randomize(small_llama()).save_pretrained(tmp_path / "hf2")
    with pytest.raises(convert.ConversionError, match="tp_size=3 does not divide"):
        convert.from_hf(
            tmp_path / "hf2", tmp_path / "ckpt", tensor_model_parallel_size=3, progress=False
        )


def test_incomplete_megafp8_checkpoints(tmp_path):
    randomize(small_gpt2()).save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    iteration = tmp_path / "ckpt" / "iter_0000000"
    with pytest.raises(convert.ConversionError, match="no megafp8 checkpoint"):
        convert.to_hf(tmp_path / "hf", tmp_path / "out", progress=False)
    with pytest.raises(convert.ConversionError, match="already holds a megafp8 checkpoint"):
        convert.from_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)

    broken = shutil.copytree(tmp_path / "ckpt", tmp_path / "no_json")
    (broken / "iter_0000000" / "megafp8.json").unlink()
    with pytest.raises(convert.ConversionError, match="no megafp8.json"):
        convert.to_hf(broken, tmp_path / "out", progress=False)

    broken = shutil.copytree(tmp_path / "ckpt", tmp_path / "no_data")
    (broken / "iter_0000000" / "__0_0.distcp").unlink()
    with pytest.raises(convert.ConversionError, match="names __0_0.distcp, which is missing"):
        convert.to_hf(broken, tmp_path / "out", progress=False)

    broken = shutil.copytree(tmp_path / "ckpt", tmp_path / "no_metadata")
    (broken / "iter_0000000" / ".metadata").unlink()
    with pytest.raises(
        convert.ConversionError, match="incomplete megafp8 checkpoint.*names iteration 0"
    ):
        convert.to_hf(broken, tmp_path / "out", progress=False)

    broken = shutil.copytree(tmp_path / "ckpt", tmp_path / "other_shape")
    info = json.loads((broken / "iter_0000000" / "megafp8.json").read_text())
    info["model"]["ffn_hidden_size"] = 128
    (broken / "iter_0000000" / "megafp8.json").write_text(json.dumps(info))
    with pytest.raises(
        convert.ConversionError,
        match=r"model/layers.0.mlp.fc1.weight is \[256, 64\].*needs "
        r"\[128, 64\]: the recorded model and the weights disagree",
    ):
        convert.to_hf(broken, tmp_path / "out", progress=False)

    info["model"].update(ffn_hidden_size=256, position_embedding="rope")
    (broken / "iter_0000000" / "megafp8.json").write_text(json.dumps(info))
    with pytest.raises(convert.ConversionError, match="no Hugging Face architecture matches"):
        convert.to_hf(broken, tmp_path / "out", progress=False)

    info["model"].update(position_embedding="learned", hidden_size=65)
    (broken / "iter_0000000" / "megafp8.json").write_text(json.dumps(info))
    with pytest.raises(
        convert.ConversionError,
        match=r"megafp8.json: its \"model\" is not a valid model config: "
        "hidden_size=65",
    ):
        convert.to_hf(broken, tmp_path / "out", progress=False)
    assert iteration.exists()


def test_command_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert.main(
            ["--direction", "from-hf", "--hf-dir", str(tmp_path), "--save", str(tmp_path / "c")]
        )
    assert exit_info.value.code == 2
    assert "convert_checkpoint: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main(["--direction", "to-hf", "--load", str(tmp_path)])
    assert "--direction to-hf needs --output" in capsys.readouterr().err


def pretrain_body(rank, world_size, argv):
    from megafp8.training.trainer import pretrain

    pretrain(argv)


@pytest.mark.parametrize("name", MODELS)
def test_pp2_training_run_to_hf_gives_the_same_logits(tmp_path, name):
    """A `megafp8-train` run with two pipeline stages (FP8, tied embeddings for GPT) converts
    like any other: the stages' checkpoint keys are the whole model's."""
    run_on_ranks(
        pretrain_body,
        2,
        [
            "--model",
            name,
            "--mock-data",
            "--train-iters",
            "2",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--seq-length",
            str(SEQ),
            "--lr",
            "1e-2",
            "--fp8-format",
            "hybrid",
            "--pipeline-model-parallel-size",
            "2",
            "--save",
            str(tmp_path / "run"),
        ],
    )
    convert.to_hf(str(tmp_path / "run"), tmp_path / "hf", progress=False, no_tokenizer=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    inputs = tokens(preset(name).vocab_size)
    with torch.no_grad():
        got = hf(inputs).logits
    assert rel_err(got, megafp8_logits(tmp_path / "run", name)) < 1e-4
