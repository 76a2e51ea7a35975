"""Starting from a trained model (`lowmem.source`): a transformers Qwen2 or Llama read into lowmem's model computes
transformers' logits, its tokenizer gives transformers' ids, an untrained import exports back to the source, and
every folder lowmem cannot start from is refused with a message before anything is loaded. CPU, float32, offline."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import llama_folder, mistral_folder, mixed_lines, qwen2_folder  # noqa: E402

from lowmem.checkpoint.export import export_model  # noqa: E402
from lowmem.cli import main  # noqa: E402
from lowmem.config import TrainConfig  # noqa: E402
from lowmem.tokenization.text_tokenizer import load_tokenizer  # noqa: E402
from lowmem.errors import ConfigError  # noqa: E402
from lowmem.hf import export_hf  # noqa: E402
from lowmem.model import GPT  # noqa: E402
from lowmem.model.safetensors_files import SafetensorsFiles, read_header  # noqa: E402
from lowmem.source.load import empty_model, fill_model, weight_plan  # noqa: E402
from lowmem.source.locate import LOWMEM, TRANSFORMERS, find_source, source_name  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and agree to the last digit between runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen2", "llama", "mistral"])
def hf_folder(request, tmp_path_factory) -> Path:
    build = {"qwen2": qwen2_folder, "llama": llama_folder, "mistral": mistral_folder}[request.param]
    return build(tmp_path_factory.mktemp(request.param) / request.param)


def _loaded(folder: Path) -> GPT:
    source = find_source(str(folder))
    model = empty_model(source.model_config)
    fill_model(model, source, weight_plan(source, source.model_config))
    return model.eval()


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(seed))


def test_the_model_reads_the_sources_shape(hf_folder):
    source = find_source(str(hf_folder))
    config = source.model_config
    assert source.kind == TRANSFORMERS and source.tokenizer_folder == hf_folder and source.chosen == "the folder given"
    assert (config.n_layer, config.n_embd, config.n_head, config.kv_heads, config.mlp_hidden) == (2, 64, 4, 2, 96)
    assert config.vocab_multiple == 1 and config.padded_vocab_size == config.vocab_size  # the source's rows
    if hf_folder.name == "qwen2":
        assert config.qkv_bias and not config.bias and config.tie_embeddings and config.rope_scaling is None
    elif hf_folder.name == "mistral":
        assert config.head_dim == 32 and not config.qkv_bias and not config.tie_embeddings
    else:
        assert not config.qkv_bias and not config.tie_embeddings and config.rope_theta == 500000.0
        assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def test_logits_equal_transformers(hf_folder):
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    ours = _loaded(hf_folder)
    ids = _ids(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids).logits
        logits, _ = ours(ids)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4
    assert expected.abs().mean().item() > 0.1  # not a comparison of near-zero numbers
    # Positions past the rotary scaling's original context too (the llama's is 128; the mistral has no window).
    long_ids = torch.randint(0, reference.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(long_ids)[0] - reference(long_ids).logits).abs().max().item() <= 1e-4


def test_the_tokenizer_gives_transformers_ids(hf_folder):
    ours, theirs = load_tokenizer(hf_folder), transformers.AutoTokenizer.from_pretrained(hf_folder)
    lines = mixed_lines(300, seed=5) + ["<|im_end|> inside", "tabs\tand\nnew lines", "emoji 😀 龘"]
    assert ours.encode_batch(lines) == theirs(lines, add_special_tokens=False)["input_ids"]
    assert ours.vocab_size == len(theirs)
    prompt = "请写一首词 please, in 2 lines"
    expected = theirs.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_dict=False) if theirs.chat_template else None
    ids, start = ours.encode_pair(prompt, None)
    assert start == len(ids) and (expected is None or ids == list(expected))


def test_a_sharded_model_loads_the_same(hf_folder, tmp_path):
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folder)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((hf_folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    ids = _ids(reference.config.vocab_size, seed=2)
    with torch.no_grad():
        assert torch.equal(_loaded(sharded)(ids)[0], _loaded(hf_folder)(ids)[0])


def test_an_untrained_import_exports_back_to_the_source(hf_folder, tmp_path):
    model = _loaded(hf_folder)
    config = TrainConfig(output_dir=str(tmp_path / "run"), tokenizer_dir=str(hf_folder))
    export_model(model, config, tmp_path / "run" / "final", str(hf_folder))
    out = export_hf(config, tmp_path / "exported")
    source_config = json.loads((hf_folder / "config.json").read_text())
    exported_config = json.loads((out / "config.json").read_text())
    assert exported_config["architectures"] == source_config["architectures"]
    for key in ("num_key_value_heads", "intermediate_size", "max_position_embeddings", "tie_word_embeddings"):
        assert exported_config[key] == source_config[key], key
    with SafetensorsFiles(read_header(hf_folder / "model.safetensors")) as original, \
            SafetensorsFiles(read_header(out / "model.safetensors")) as exported:
        assert set(exported.entries) - {"lm_head.weight"} == set(original.entries) - {"lm_head.weight"}
        for name, entry in original.entries.items():
            difference = (exported.read_rows(name, 0, entry.shape[0]).float()
                          - original.read_rows(name, 0, entry.shape[0]).float()).abs().max().item()
            assert difference <= 1e-5, name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(reloaded.config.vocab_size, seed=3)
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids)[0]).abs().max().item() <= 1e-4
    lines = mixed_lines(50, seed=7)
    assert transformers.AutoTokenizer.from_pretrained(out)(lines, add_special_tokens=False)["input_ids"] == \
        load_tokenizer(hf_folder).encode_batch(lines)


def test_a_lowmem_run_folder_is_read_by_its_best_then_final_then_newest_checkpoint(tmp_path):
    from lowmem.checkpoint.marker import new_marker, write_marker
    from lowmem.model import GPTConfig
    from lowmem.model.weights import save_model_config, save_weights

    config = GPTConfig(vocab_size=300, max_seq_len=64, n_layer=1, n_head=2, n_embd=32, architecture="llama")
    run = tmp_path / "stage1"
    for step in (10, 20):
        folder = run / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_weights(GPT(config), folder / "model.safetensors")
        save_model_config(config, folder)
        write_marker(folder, new_marker(folder, step, "val_loss", None, None, sync=False))
    assert find_source(str(run)).folder == run / "checkpoint-20"
    assert "newest complete checkpoint" in find_source(str(run)).chosen
    for name in ("final", "best"):
        (run / name).mkdir()
        save_weights(GPT(config), run / name / "model.safetensors")
        save_model_config(config, run / name)
        found = find_source(str(run))
        assert found.folder == run / name and found.kind == LOWMEM and found.chosen.startswith(f"the run's {name}/")
    assert source_name(str(run)) == source_name(str(run / "best")) == "stage1"
    assert source_name(str(run / "checkpoint-20")) == "stage1-20"


def _rewrite_tensors(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def qwen_copy(tmp_path_factory, tmp_path) -> Path:
    import shutil

    original = tmp_path_factory.getbasetemp() / "qwen2-original"
    if not original.exists():
        qwen2_folder(original)
    shutil.copytree(original, tmp_path / "copy")
    return tmp_path / "copy"


@pytest.mark.parametrize("damage, expected", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"), "no tensor model.layers.1.self_attn.k_proj.bias"),
    (lambda t: t.update(extra=torch.zeros(3)), "tensors its config does not describe: extra"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}),
     "model.layers.0.mlp.up_proj.weight of shape [95, 64]"),
])
def test_a_tensor_missing_extra_or_of_another_shape_is_named(qwen_copy, damage, expected):
    _rewrite_tensors(qwen_copy, damage)
    source = find_source(str(qwen_copy))
    with pytest.raises(ConfigError, match="nothing was loaded") as refused:
        weight_plan(source, source.model_config)
    assert expected in str(refused.value)


class _Planted:
    """A pickle that would create a file if it were ever loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_only_folder_is_refused_without_being_opened(qwen_copy, tmp_path):
    control, marker = tmp_path / "control-ran", tmp_path / "pickle-ran"
    pickle.loads(pickle.dumps(_Planted(control)))
    assert control.exists()  # the planted pickle does run its command when it is loaded
    (qwen_copy / "model.safetensors").unlink()
    (qwen_copy / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ConfigError, match="pickles .*pytorch_model.bin.*save_pretrained") as refused:
        find_source(str(qwen_copy))
    assert "has not opened them" in str(refused.value) and not marker.exists()


@pytest.mark.parametrize("config, expected", [
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "is a BertForMaskedLM: lowmem starts from"),
    ({"architectures": ["T5ForConditionalGeneration"]}, "T5ForConditionalGeneration"),
    ({"architectures": ["Qwen2ForCausalLM"], "quantization_config": {"quant_method": "gptq"}}, "quantized (gptq)"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
])
def test_a_model_lowmem_does_not_compute_is_refused(qwen_copy, config, expected):
    written = {**json.loads((qwen_copy / "config.json").read_text()), **config}
    written.pop("rope_parameters", None) if "rope_scaling" in config else None
    (qwen_copy / "config.json").write_text(json.dumps(written))
    with pytest.raises(ConfigError) as refused:
        find_source(str(qwen_copy))
    assert expected in str(refused.value)


def test_a_path_that_holds_no_model_says_what_to_pass(tmp_path):
    with pytest.raises(ConfigError, match="no such file or folder"):
        find_source(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no model lowmem can start from"):
        find_source(str(tmp_path / "empty"))


def test_a_damaged_safetensors_header_is_named(qwen_copy):
    path = qwen_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        find_source(str(qwen_copy))


def test_generation_stops_at_any_of_several_ids():
    from lowmem.model import GPTConfig

    model = GPT(GPTConfig(vocab_size=10, max_seq_len=32, n_layer=1, n_head=1, n_embd=8, architecture="llama"))
    script = iter([3, 7, 5, 5, 5])
    model.next_token_logits = lambda idx: torch.nn.functional.one_hot(  # type: ignore[method-assign]
        torch.full((idx.size(0),), next(script)), 64).float()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=5, greedy=True, eos_id=(9, 7))
    assert out[0, 1:].tolist() == [3, 7]


# ----- bad inputs on the command line: one paragraph, exit code 2, nothing written ----------------------------------
@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A folder with data of one's own (data/train.parquet, ...), the current folder of the command."""
    from training_helpers import write_chat_rows

    (tmp_path / "data").mkdir()
    for name, seed in (("train", 1), ("valid", 2), ("test", 3)):
        write_chat_rows(tmp_path / "data" / f"{name}.parquet", 40, seed=seed)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _bert_folder(folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))


def _fewer_rows_than_ids(folder: Path) -> None:
    """The embedding cut to 500 rows, below the tokenizer's 603 ids."""
    _rewrite_tensors(folder, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:500]}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))


def _edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _nan_in_one_weight(folder: Path) -> None:
    def plant(tensors):
        weight = tensors["model.layers.1.mlp.down_proj.weight"].clone()
        weight[3, 5] = float("nan")
        tensors["model.layers.1.mlp.down_proj.weight"] = weight
    _rewrite_tensors(folder, plant)


@pytest.mark.parametrize("case", ["pickle", "bert", "missing tensor", "tokenizer too large", "no such path",
                                  "keep training an empty folder", "shape flag", "nan weight", "no heads field",
                                  "heads that contradict the tensors", "unreadable field", "pairs of one answer"])
def test_a_bad_init_from_is_one_message_and_writes_nothing(project, qwen_copy, capsys, case):
    model, flags = str(qwen_copy), []
    marker = project / "pickle-ran"
    if case == "pickle":
        (qwen_copy / "model.safetensors").unlink()
        (qwen_copy / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker)))
    elif case == "bert":
        model = str(project / "bert")
        _bert_folder(project / "bert")
    elif case == "missing tensor":
        _rewrite_tensors(qwen_copy, lambda t: t.pop("model.norm.weight"))
    elif case == "tokenizer too large":
        _fewer_rows_than_ids(qwen_copy)
    elif case == "no such path":
        model = str(project / "nowhere")
    elif case == "keep training an empty folder":
        flags = ["--is_keep_training=True"]
    elif case == "nan weight":
        _nan_in_one_weight(qwen_copy)
    elif case == "no heads field":
        _edit_config(qwen_copy, lambda config: config.pop("num_attention_heads"))
    elif case == "heads that contradict the tensors":
        _edit_config(qwen_copy, lambda config: config.update(num_attention_heads=8, num_key_value_heads=8))
    elif case == "unreadable field":
        _edit_config(qwen_copy, lambda config: config.update(hidden_size="wide"))
    elif case == "pairs of one answer":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for name in ("train", "valid"):
            answers = [f"answer {row}" for row in range(50)]
            pq.write_table(pa.table({"prompt": [f"q {row}" for row in range(50)], "chosen": answers,
                                     "rejected": answers}), project / "data" / f"{name}.parquet")
        flags = ["--objective=dpo"]
    else:
        flags = ["--n_layer=3"]
    expected = {"pickle": "has not opened them", "bert": "is a BertForMaskedLM: lowmem starts from",
                "missing tensor": "has no tensor model.norm.weight", "tokenizer too large": "603 ids but",
                "no such path": "no such file or folder",
                "keep training an empty folder": "--is_keep_training=True continues the run in",
                "shape flag": "--n_layer=3 (the model has 2) disagree",
                "nan weight": "not finite (NaN or infinity) in model.layers.1.mlp.down_proj.weight",
                "no heads field": "has no 'num_attention_heads', which lowmem needs",
                "heads that contradict the tensors": "its weights do not match its config.json",
                "unreadable field": "holds a value lowmem cannot read",
                "pairs of one answer": "has the same chosen and rejected answer: they carry no preference"}[case]
    assert main(["train", f"--init_from={model}", "--max_steps=1", *flags]) == 2
    message = capsys.readouterr().err
    errors = [line for line in message.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], message
    assert "Traceback" not in message and not marker.exists()
    assert not (project / "model_save").exists() and not (project / "logs").exists()



def test_a_sequence_longer_than_the_sliding_window_is_refused(tmp_path, capsys, monkeypatch):
    from training_helpers import write_chat_rows

    model = mistral_folder(tmp_path / "mistral-window", sliding_window=128)
    (tmp_path / "data").mkdir()
    for name, seed in (("train", 1), ("valid", 2), ("test", 3)):
        write_chat_rows(tmp_path / "data" / f"{name}.parquet", 40, seed=seed)
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"--init_from={model}", "--max_seq_len=256", "--max_steps=1"]) == 2
    assert "--max_seq_len=256 is longer than its sliding attention window, 128 tokens" in capsys.readouterr().err
    assert not (tmp_path / "model_save").exists()


def test_another_checkpoint_of_the_same_shapes_is_told_apart_by_its_bytes(qwen_copy, tmp_path):
    """The fingerprint a run and precomputed reference values record of their model is of the weights' bytes, read
    in the scan that checks them for NaN: a checkpoint of the same architecture with other values (a later step of
    the same run) is refused where the headers' fingerprint alone would take it."""
    from lowmem.preference.precompute import RECORD_NAME, check_precomputed
    from lowmem.source.finite import check_finite, content_fingerprint
    from lowmem.source.settle import StartingPoint, source_record

    def fingerprints(folder: Path) -> dict[str, str]:
        source = find_source(str(folder))
        check_finite(source)
        record = source_record(StartingPoint(source.model_config, source), TrainConfig(init_from=str(folder)))
        assert record["content_sha256"] == content_fingerprint(source) == source.content_sha256
        return {key: record[key] for key in ("tensors_sha256", "content_sha256")}

    before = fingerprints(qwen_copy)
    assert fingerprints(qwen_copy) == before  # the same bytes, the same fingerprint
    _rewrite_tensors(qwen_copy, lambda tensors: tensors["model.norm.weight"].mul_(1.01))
    after = fingerprints(qwen_copy)
    assert after["tensors_sha256"] == before["tensors_sha256"] and after["content_sha256"] != before["content_sha256"]

    values = tmp_path / "pairs.reference"
    values.mkdir()
    (values / RECORD_NAME).write_text(json.dumps({"complete": True, "max_seq_len": 64, "init_from": "qwen", **before}))
    assert check_precomputed(str(values), 64, before) is None
    with pytest.raises(ConfigError, match="whose tensors are not those of the model this run starts from"):
        check_precomputed(str(values), 64, after)
    # Values recorded before the bytes were fingerprinted are compared by the headers' fingerprint.
    (values / RECORD_NAME).write_text(json.dumps({"complete": True, "max_seq_len": 64,
                                                  "tensors_sha256": before["tensors_sha256"]}))
    assert check_precomputed(str(values), 64, after) is None
