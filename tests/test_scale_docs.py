"""The Python snippets of docs/scale.md run as written, on a tiny GPT-2
built here, and print what the metric computes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torchmetrics")

from pipeline.core.probability import probs_of_record  # noqa: E402
from pipeline.metrics import full_ece  # noqa: E402
from tests.helpers.extract_models import build_gpt2, synthetic_texts  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "scale.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

    directory = build_gpt2(tmp_path_factory.mktemp("scale") / "gpt2", vocab_size=300, scale=0.5)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    texts = synthetic_texts(12, seed=5, min_words=2, max_words=8)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batches = [collator([{"input_ids": i} for i in ids[s : s + 4]]) for s in range(0, 12, 4)]
    return {"model": model, "tokenizer": tokenizer, "ids": ids, "batches": batches}


def test_doc_has_the_two_snippets():
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert "TokenCalibrationError" in blocks[0] and "CalibrationTracker" in blocks[1]


@pytest.mark.slow
def test_metric_snippet(tiny, capsys):
    namespace = {"model": tiny["model"], "device": "cpu", "eval_batches": tiny["batches"]}
    exec(_python_blocks()[0], namespace)
    printed = capsys.readouterr().out
    assert "'full_ece@10'" in printed and "'ece@10'" in printed
    # the value it printed is the functional API's on the same positions
    with torch.no_grad():
        logits = [tiny["model"](input_ids=torch.tensor([i])).logits[0, :-1] for i in tiny["ids"]]
    probs = probs_of_record(torch.cat(logits))
    labels = torch.cat([torch.tensor(i[1:]) for i in tiny["ids"]])
    expected = full_ece(probs, labels, 10)
    assert float(namespace["values"]["full_ece@10"]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow
def test_trainer_snippet(tiny, tmp_path, capsys):
    namespace = {
        "model": tiny["model"],
        "tokenizer": tiny["tokenizer"],
        "out_dir": tmp_path / "out",
        "train_dataset": _Sequences(tiny["ids"] * 4),
        "eval_dataset": _Sequences(tiny["ids"]),
    }
    exec(_python_blocks()[1], namespace)
    printed = capsys.readouterr().out
    assert [e["step"] for e in namespace["evaluations"]] == [2, 4]
    assert "[(2, " in printed and "(4, " in printed
    assert namespace["tracker"].last["full_ece@10"] == pytest.approx(
        namespace["evaluations"][-1]["eval_full_ece@10"], abs=1e-12
    )
