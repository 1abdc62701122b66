"""RunWriter: the extraction kernel as a library, checked against `fullece extract`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.extract import ExtractError, RunWriter, run_extraction  # noqa: E402
from pipeline.store.manifest import load_manifest  # noqa: E402
from tests.helpers.extract_models import synthetic_texts, write_corpus  # noqa: E402

QUIET = {"progress": False, "device": "cpu"}
TABLES = ("class_bins", "top1_bins", "tokens", "seq_bins")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_gpt2):
    base = tmp_path_factory.mktemp("rw")
    model = tiny_gpt2
    texts = synthetic_texts(25, seed=3, min_words=2, max_words=25)
    corpus = write_corpus(base / "c.txt", texts)
    return model, corpus, texts


def _user_loop_batches(model_dir, texts):
    """What a user's own loop holds: per document, logits [T-1, K] and labels."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.inference_mode():
        for d, text in enumerate(texts):
            ids = tok(text)["input_ids"]
            if len(ids) < 2:
                continue
            logits = lm(input_ids=torch.tensor([ids])).logits[0, :-1]
            yield d, logits, torch.tensor(ids[1:])


def _table(path):
    return pq.read_table(path)


def _aggregate(run):
    from pipeline.aggregate import aggregate

    out, _ = aggregate(run, progress=False)
    return {name: _table(out / f"{name}.parquet") for name in TABLES}


@pytest.mark.parametrize("store", ["topk", "full"])
def test_runwriter_gives_the_tables_of_fullece_extract(setup, tmp_path, store):
    model, corpus, texts = setup
    ref = run_extraction(model, corpus, tmp_path / "ref", store=store, k=8, batch_size=1, **QUIET)
    vocab = ref["vocab_size"]
    with RunWriter(tmp_path / "rw", vocab_size=vocab, store=store, k=8, label="mine") as w:
        for d, logits, labels in _user_loop_batches(model, texts):
            n = len(labels)
            w.add(logits, labels, doc_ids=np.full(n, d), offsets=np.arange(1, n + 1))
    got = load_manifest(tmp_path / "rw")
    assert got["complete"] and got["label"] == "mine" and got["source"]["kind"] == "runwriter"
    assert got["positions"] == ref["positions"] and got["m_exact"] == ref["m_exact"]
    a = pq.read_table(tmp_path / "ref" / ref["shards"][0]["positions"])
    b = pq.read_table(tmp_path / "rw" / got["shards"][0]["positions"])
    assert a.schema == b.schema
    for name in a.schema.names:
        assert a.column(name).equals(b.column(name)), name
    ta, tb = _aggregate(tmp_path / "ref"), _aggregate(tmp_path / "rw")
    for name in TABLES:
        assert ta[name].equals(tb[name]), name
    # the run validates as any other
    from pipeline.aggregate.validate import find_problems

    assert find_problems(tmp_path / "rw", first_only=False) == []


def test_runwriter_shards_resume_and_devices(setup, tmp_path):
    """Shards close after shard_positions rows; an interrupted writer resumes by
    skipping the committed rows; numpy logits work like torch ones."""
    model, _, texts = setup
    batches = list(_user_loop_batches(model, texts))
    vocab = batches[0][1].shape[1]
    out = tmp_path / "run"

    def feed(w, stop=None):
        for i, (d, logits, labels) in enumerate(batches):
            if stop is not None and i == stop:
                raise KeyboardInterrupt
            w.add(logits.numpy(), labels.numpy(), doc_ids=np.full(len(labels), d))

    with pytest.raises(KeyboardInterrupt):
        with RunWriter(out, vocab_size=vocab, shard_positions=60) as w:
            feed(w, stop=12)
    part = load_manifest(out)
    assert not part["complete"] and len(part["shards"]) >= 2
    with RunWriter(out, vocab_size=vocab, shard_positions=60) as w:
        assert w.committed_positions == part["positions"]
        feed(w)
    done = load_manifest(out)
    with RunWriter(tmp_path / "ref", vocab_size=vocab, shard_positions=60) as w:
        feed(w)
    ref = load_manifest(tmp_path / "ref")
    assert done["complete"] and [s["files"] for s in done["shards"]] == [
        s["files"] for s in ref["shards"]
    ]
    assert all(s["rows"] >= 60 for s in done["shards"][:-1])


def test_runwriter_bad_input(tmp_path):
    with pytest.raises(ExtractError, match="larger than"):
        RunWriter(tmp_path / "a", vocab_size=4, k=8)
    with RunWriter(tmp_path / "b", vocab_size=5, k=2) as w:
        with pytest.raises(ExtractError, match=r"shape \(3, 4\)"):
            w.add(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))
        with pytest.raises(ExtractError, match=r"label id\(s\) \[7\]"):
            w.add(torch.zeros(2, 5), torch.tensor([1, 7]))
        with pytest.raises(ExtractError, match="NaN or infinite logit at document 0"):
            w.add(torch.tensor([[0.0, float("nan"), 0, 0, 0]]), torch.tensor([1]))
        w.add(torch.zeros(2, 5), torch.tensor([0, 1]))
    assert load_manifest(tmp_path / "b")["positions"] == 2
    assert Path(tmp_path / "b").is_dir()


def test_docs_example_runs_and_measures(tmp_path, monkeypatch):
    """The example of docs/api-runwriter.md runs as written and gives a valid run."""
    import re

    from click.testing import CliRunner

    from pipeline.cli import main

    doc = (Path(__file__).resolve().parent.parent / "docs" / "api-runwriter.md").read_text()
    code = re.search(r"## Example.*?```python\n(.*?)```", doc, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/api-runwriter.md", "exec"), {})  # noqa: S102 - the doc's own code
    m = load_manifest(tmp_path / "runs" / "custom")
    assert m["complete"] and m["positions"] == 40 * 32 and m["label"] == "custom"
    res = CliRunner().invoke(main, ["validate", "runs/custom"])
    assert res.exit_code == 0 and "valid" in res.output, res.output
    res = CliRunner().invoke(main, ["metrics", "runs/custom", "--json"])
    assert res.exit_code == 0, res.output
