"""CalibrationTracker inside a real transformers.Trainer: a tiny GPT-2 is
trained for a few steps with evaluations, and the logged Full-ECE and ECE
equal `fullece extract` + `fullece metrics` of the saved checkpoint on the
same evaluation token sequences."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torchmetrics")

from pipeline.core.metrics import calibration_errors  # noqa: E402
from pipeline.core.probability import probs_of_record  # noqa: E402
from pipeline.defaults import PAPER_BINS  # noqa: E402
from pipeline.integrations.transformers import CalibrationTracker  # noqa: E402
from tests.helpers.extract_models import build_gpt2, synthetic_texts, token_sequences, write_corpus  # noqa: E402


def test_hooks_shift_labels_and_return_something_tiny():
    g = torch.Generator().manual_seed(0)
    k = 11
    logits = torch.randn(3, 9, k, generator=g) * 3
    labels = torch.randint(0, k, (3, 9), generator=g)
    labels[2, 5:] = -100  # right padding, as the Trainer pads
    tracker = CalibrationTracker(vocab_size=k, n_bins=(5, 10), classwise=True)
    small = tracker.preprocess_logits_for_metrics((logits, "extra output"), labels)
    assert small.shape == (3,)
    assert tracker.compute_metrics(None, compute_result=False) == {}
    values = tracker.compute_metrics(None)
    probs = probs_of_record(logits[:, :-1].reshape(-1, k))
    y = labels[:, 1:].reshape(-1)
    keep = y != -100
    for m in (5, 10):
        expected = calibration_errors(probs[keep], y[keep], m)
        assert values[f"full_ece_m{m}"] == pytest.approx(expected["full_ece"], abs=1e-12)
        assert values[f"ece_m{m}"] == pytest.approx(expected["ece"], abs=1e-12)
        assert values[f"cw_ece_m{m}"] == pytest.approx(expected["cw_ece"], abs=1e-12)
    assert tracker.last == values
    assert int(tracker.metric.positions) == 0  # reset for the next evaluation
    with pytest.raises(ValueError, match="needs labels"):
        tracker.preprocess_logits_for_metrics(logits, None)


@pytest.mark.slow
@pytest.mark.parametrize("batch_eval_metrics", [False, True])
def test_trainer_logs_the_values_of_extract_and_metrics(tmp_path, batch_eval_metrics):
    from click.testing import CliRunner
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    from pipeline.cli import main

    model_dir = build_gpt2(tmp_path / "init", vocab_size=300, n_positions=128, scale=0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    k = model.config.vocab_size

    def encode(texts):
        ids = [tokenizer(t)["input_ids"] for t in texts]
        assert all(2 <= len(i) <= 128 for i in ids)  # one window each
        return ids

    train_texts = synthetic_texts(32, seed=1, min_words=2, max_words=12)
    eval_texts = synthetic_texts(10, seed=2, min_words=2, max_words=12)
    train, evaluation = token_sequences(encode(train_texts)), token_sequences(encode(eval_texts))

    tracker = CalibrationTracker(vocab_size=k)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=4,  # padded batches: -100 labels are skipped
        learning_rate=5e-3,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        batch_eval_metrics=batch_eval_metrics,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        preprocess_logits_for_metrics=tracker.preprocess_logits_for_metrics,
        compute_metrics=tracker.compute_metrics,
    )
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_full_ece_m10" in e]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert {f"eval_{n}_m{m}" for n in ("ece", "full_ece") for m in PAPER_BINS} <= set(e)
    assert evals[0]["eval_full_ece_m10"] != evals[1]["eval_full_ece_m10"]  # training moved it

    checkpoint = tmp_path / "ckpt"
    trainer.save_model(str(checkpoint))
    tokenizer.save_pretrained(checkpoint)
    corpus = write_corpus(tmp_path / "eval.txt", eval_texts)
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "extract",
            "--model",
            str(checkpoint),
            "--corpus",
            str(corpus),
            "--out",
            str(tmp_path / "run"),
            "--device",
            "cpu",
            "--k",
            str(k),  # every entry kept: no tail, every M exact
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["metrics", str(tmp_path / "run"), "--json", "--quiet"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    positions = sum(len(i) - 1 for i in evaluation.ids)
    assert report["positions"] == positions
    last = evals[-1]
    for row in report["bins"]:
        assert row["exact"], row
        m = row["M"]
        assert last[f"eval_full_ece_m{m}"] == pytest.approx(row["full_ece"], abs=1e-6), m
        assert last[f"eval_ece_m{m}"] == pytest.approx(row["ece"], abs=1e-6), m


_DDP_EVALUATE = r"""
import json, sys
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          Trainer, TrainingArguments)
from pipeline.integrations.transformers import CalibrationTracker

model_dir, out = sys.argv[1], sys.argv[2]
ids = json.loads(open(sys.argv[3]).read())
tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)


class Sequences(torch.utils.data.Dataset):
    def __len__(self):
        return len(ids)

    def __getitem__(self, i):
        return {"input_ids": ids[i]}


tracker = CalibrationTracker(vocab_size=model.config.vocab_size, n_bins=(5, 10, 20))
local_positions = []


def compute_metrics(eval_pred=None):
    local_positions.append(int(tracker.metric.positions))  # this process's share
    return tracker.compute_metrics(eval_pred)


args = TrainingArguments(output_dir=out, per_device_eval_batch_size=2, report_to=[],
                         use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=model, args=args, eval_dataset=Sequences(),
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                  preprocess_logits_for_metrics=tracker.preprocess_logits_for_metrics,
                  compute_metrics=compute_metrics)
metrics = trainer.evaluate()
local = {"world_size": trainer.args.world_size, "metrics": metrics,
         "local_positions": local_positions}
with open(f"{out}/rank{trainer.args.process_index}.json", "w") as fh:
    json.dump(local, fh)
"""


@pytest.mark.slow
def test_two_process_evaluation_under_torchrun(tmp_path):
    """torchrun --nproc-per-node 2 (gloo): each process reduces its own
    batches and every process logs the values of the whole evaluation set."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun is installed with torch"
    model_dir = build_gpt2(tmp_path / "m", vocab_size=300, n_positions=128, scale=0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = [tokenizer(t)["input_ids"] for t in synthetic_texts(8, seed=4, min_words=2, max_words=8)]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    (tmp_path / "evaluate.py").write_text(_DDP_EVALUATE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [
            torchrun,
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(tmp_path / "evaluate.py"),
            str(model_dir),
            str(tmp_path),
            str(tmp_path / "ids.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    positions = sum(len(i) - 1 for i in ids)
    shares = [r["local_positions"][0] for r in ranks]
    assert sum(shares) == positions and 0 < shares[0] < positions  # each its own half

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        logits = torch.cat([model(input_ids=torch.tensor([i])).logits[0, :-1] for i in ids])
    probs = probs_of_record(logits)
    labels = torch.cat([torch.tensor(i[1:]) for i in ids])
    for r in ranks:
        for m in (5, 10, 20):
            expected = calibration_errors(probs, labels, m)
            assert r["metrics"][f"eval_full_ece_m{m}"] == pytest.approx(
                expected["full_ece"], abs=1e-6
            )
            assert r["metrics"][f"eval_ece_m{m}"] == pytest.approx(expected["ece"], abs=1e-6)
