"""sft stage: both variants end to end on a tiny random model (TRL SFTTrainer + PEFT LoRA), reward tokens as
single ids that survive save + reload, assistant-only loss, resume after an interruption, MLflow logging,
and bad params / inputs failing before training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from helpers import (
    HIGH,
    LEVELS,
    LOW,
    assert_same_adam_step,
    chat,
    compute_from_params,
    config_from_params,
    grad_capture,
    on_test_device,
    pack_spy,
    resolved,
    snapshot,
    tiny_sft_config,
)
from helpers import write_params as committed_with

from rcgrpo import tokens as reward_tokens
from rcgrpo_tasks.engine import models
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_jsonl
from rcgrpo_tasks.stages import sft as sft_stage
from rcgrpo_tasks.train.common import adapters, callbacks, checkpoints, model_registry, runs
from rcgrpo_tasks.train.sft import config as sft_config
from rcgrpo_tasks.train.sft import rows as sft_rows
from rcgrpo_tasks.train.sft import run as sft_run
from rcgrpo_tasks.train.sft import trainer as sft_trainer


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft_data")
    write_jsonl(root / "sft.jsonl", [chat(i, None) for i in range(16)])
    write_jsonl(root / "rctp.jsonl", [chat(i, HIGH if i % 2 else LOW) for i in range(16)])
    return root


def spec(root: Path, model_dir: Path, variant: str, data: Path, name: str | None = None) -> sft_config.SftRun:
    name = name or variant
    return sft_config.SftRun(variant, model_dir, data, root / "out" / name, root / "ckpt" / name,
                       root / "res" / f"{name}.json", root / "res" / f"{name}.tsv")


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("variant", ["sft", "rctp"])
def test_variant_end_to_end(variant, datasets, tiny_model_dir, tmp_path):
    """Loss goes down, LoRA (and, for RCTP, the reward-token rows) change, outputs are written and reload."""
    import torch

    snap = snapshot()
    cfg = tiny_sft_config(require_reward_token=variant == "rctp", keep_checkpoints=True)
    s = spec(tmp_path, tiny_model_dir, variant, datasets / f"{variant}.jsonl")
    summary = sft_run.train_variant(cfg, LEVELS, s, callbacks=[snap], track=False, compute=compute_from_params())

    assert summary["steps"] == 6 and summary["resumed_from"] is None
    assert summary["loss_last"] < summary["loss_first"] - 0.05, summary
    assert snap.changed("lora_B"), "LoRA weights did not move"
    # The reward-token rows move in both variants: as inputs in RCTP prompts, and (tied embeddings) as LM-head
    # rows in every softmax over the vocabulary.
    assert snap.changed("trainable_tokens_delta"), "reward-token embedding rows did not move"

    rows = [line.split("\t") for line in s.plots.read_text().splitlines()]
    assert rows[0][:3] == ["step", "epoch", "loss"] and len(rows) == 7
    assert json.loads(s.metrics.read_text())["steps"] == 6
    meta = json.loads((s.out / sft_run.META_FILE).read_text())
    assert meta["variant"] == variant and set(meta["special_tokens"]) == set(LEVELS)
    assert (s.out / "adapter_config.json").is_file() and (s.out / "tokenizer.json").is_file()
    # small adapter: LoRA + the two trainable rows, never the resized 49k-row embedding matrices
    assert (s.out / "adapter_model.safetensors").stat().st_size < 2_000_000
    assert sorted(p.name for p in s.checkpoints.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]

    model, tokenizer = models.load_trained(tiny_model_dir, s.out)
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n or "trainable_tokens_delta" in n}
    for name, value in snap.after.items():  # trained on the device under test, reloaded on the CPU
        if name in trained:
            torch.testing.assert_close(trained[name], value.cpu())
    for tok in LEVELS:  # one id each, after save + reload
        assert len(tokenizer(tok, add_special_tokens=False)["input_ids"]) == 1


def test_reward_tokens_single_ids_after_reload(datasets, tiny_model_dir, tmp_path):
    """Each reward token is one id, the same id before and after reload, and the reloaded model computes
    the same logits on a reward-conditioned prompt as the trained one."""
    import torch
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(base_tok(HIGH, add_special_tokens=False)["input_ids"]) > 1  # not in SmolLM2's vocabulary
    s = spec(tmp_path, tiny_model_dir, "rctp", datasets / "rctp.jsonl")
    summary = sft_run.train_variant(tiny_sft_config(max_steps=2), LEVELS, s, track=False, compute=compute_from_params())
    assert not list(s.checkpoints.glob("checkpoint-*"))  # cleaned after success (keep_checkpoints: false)
    ids = summary["special_tokens"]
    assert len(set(ids.values())) == 2 and min(ids.values()) >= len(base_tok)

    model, tok = models.load_trained(tiny_model_dir, s.out)
    prompt = tok.apply_chat_template(chat(3, HIGH)["messages"][:2], tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, add_special_tokens=False, return_tensors="pt")
    assert (enc["input_ids"][0] == ids[HIGH]).sum() == 1
    for t in LEVELS:
        assert tok(t, add_special_tokens=False)["input_ids"] == [ids[t]]
    model.eval()
    again, _ = models.load_trained(tiny_model_dir, s.out)
    again.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, again(**enc).logits)
        merged = again.merge_and_unload()  # what RL does: the reward rows live on in the merged weights
        torch.testing.assert_close(model(**enc).logits, merged(**enc).logits, atol=1e-4, rtol=1e-4)


def test_assistant_only_labels(datasets, tiny_model_dir, tmp_path):
    """The labels TRL trains on are exactly the assistant replies (+ their end-of-turn token)."""
    from rcgrpo_tasks.data.chat import assistant_token_mask

    rows = sft_rows.load_rows(datasets / "rctp.jsonl", LEVELS, True)
    trainer = sft_trainer.build_trainer(resolved(tiny_sft_config()), tiny_model_dir, rows[:2], LEVELS, tmp_path / "ck")
    tok, stats, ex = trainer.processing_class, trainer.data_stats, trainer.train_dataset[0]
    ids, mask = assistant_token_mask(tok, rows[0]["messages"])
    assert ex["input_ids"] == ids
    learned = tok.decode([i for i, lab in zip(ex["input_ids"], ex["labels"]) if lab != -100])
    assert learned == "[add(a=0, b=0)]<|im_end|>[done()]<|im_end|>"
    assert stats["assistant_tokens"] == sum(mask) + sum(assistant_token_mask(tok, rows[1]["messages"])[1])


def test_a_finished_run_rerun_is_restored_not_trained_a_step_further(datasets, tiny_model_dir, tmp_path):
    """A killed run whose last step was checkpointed, rerun: restored from it, not trained a step further.
    (That a run cut earlier resumes to the uninterrupted run, bit for bit: tests/test_resume.py.)"""
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class Killed(RuntimeError):
        pass

    class KillAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise Killed("simulated kill")

    data = datasets / "rctp.jsonl"
    done = spec(tmp_path, tiny_model_dir, "rctp", data, "done")
    four = tiny_sft_config(lora_dropout=0.1, max_steps=4, keep_checkpoints=True)
    with pytest.raises(Killed):
        sft_run.train_variant(four, LEVELS, done, callbacks=[KillAfterSave()], track=False, compute=compute_from_params())
    assert not done.out.exists()
    ckpt = load_file(done.checkpoints / "checkpoint-4" / "adapter_model.safetensors")
    summary = sft_run.train_variant(four, LEVELS, done, track=False, compute=compute_from_params())
    assert summary["resumed_from"].endswith("checkpoint-4") and summary["steps"] == 4
    assert not (done.checkpoints / "checkpoint-5").exists()
    restored = load_file(done.out / "adapter_model.safetensors")
    assert ckpt.keys() == restored.keys() and all(torch.equal(restored[k], ckpt[k]) for k in ckpt)


def test_sigterm_checkpoints_the_current_step_and_exits_143(datasets, tiny_model_dir, tmp_path):
    """SIGTERM mid-run (dvc / Prefect cancel): the step under way is finished and checkpointed (off the
    save_steps grid), nothing is written, the run ends with exit status 143; the re-run resumes there."""
    import os
    import signal

    from transformers import TrainerCallback

    class Term(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # during step 3
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    s = spec(tmp_path, tiny_model_dir, "rctp", datasets / "rctp.jsonl")
    cfg = tiny_sft_config(save_steps=4)
    with pytest.raises(callbacks.Interrupted) as info:
        sft_run.train_variant(cfg, LEVELS, s, callbacks=[Term()], track=False, compute=compute_from_params())
    assert info.value.code == 143 and signal.getsignal(signal.SIGTERM) is before
    assert not s.out.exists() and not s.metrics.exists() and not s.plots.exists()
    assert sorted(p.name for p in s.checkpoints.glob("checkpoint-*")) == ["checkpoint-3"]
    summary = sft_run.train_variant(cfg, LEVELS, s, track=False, compute=compute_from_params())
    assert summary["resumed_from"].endswith("checkpoint-3") and summary["steps"] == 6


def test_a_step_longer_than_the_grace_stops_at_once(datasets, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A step that outlasts `STOP_GRACE_S` after the signal is cut short: the run stops at once (one line on
    stderr), keeps only its periodic checkpoints, and the alarm is disarmed afterwards."""
    import os
    import signal
    import time

    from transformers import TrainerCallback

    class SlowStep(TrainerCallback):
        slept = False

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the step "runs on" far past the grace
                SlowStep.slept = True

    monkeypatch.setattr(callbacks, "STOP_GRACE_S", 0.2)
    s = spec(tmp_path, tiny_model_dir, "rctp", datasets / "rctp.jsonl")
    with pytest.raises(callbacks.Interrupted) as info:
        sft_run.train_variant(tiny_sft_config(save_steps=2), LEVELS, s, callbacks=[SlowStep()], track=False, compute=compute_from_params())
    assert info.value.code == 143 and not SlowStep.slept  # stopped inside the over-long step, not after it
    assert "SIGTERM received: stopping after the current step" in capsys.readouterr().err
    assert sorted(p.name for p in s.checkpoints.glob("checkpoint-*")) == ["checkpoint-2"]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and not s.out.exists()


def test_sigterm_outside_the_training_loop_exits_at_once():
    import os
    import signal
    import time

    with callbacks.stop_on_signal() as stop, pytest.raises(callbacks.Interrupted) as info:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.01)
    assert info.value.code == 143 and stop.received is None


def _model_only_checkpoint(folder: Path) -> None:
    """A checkpoint holding just the model and the Trainer state (what `save_only_model` writes)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')


def test_checkpoints_of_other_params_are_discarded(tmp_path):
    ck = tmp_path / "ck"
    _model_only_checkpoint(ck / "checkpoint-2")
    (ck / "checkpoint-3").mkdir()  # killed while being written: no trainer_state.json
    assert checkpoints.last_checkpoint(ck, "fp-a") is None  # no fingerprint file: not ours
    _model_only_checkpoint(ck / "checkpoint-2")
    (ck / "checkpoint-3").mkdir()
    assert checkpoints.last_checkpoint(ck, "fp-a").endswith("checkpoint-2")
    assert checkpoints.last_checkpoint(ck, "fp-b") is None and not (ck / "checkpoint-2").exists()


# ------------------------------------------------------------------------------------------ MLflow


def test_mlflow_run_logs_params_steps_and_loadable_model(datasets, tiny_model_dir, tmp_path, monkeypatch):
    import mlflow
    import torch

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "mlartifacts"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test-sft")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")  # sampling thread: not in a 3 s run
    s = dataclasses.replace(spec(tmp_path, tiny_model_dir, "rctp", datasets / "rctp.jsonl"), grid_seed=2)
    sft_run.train_variant(tiny_sft_config(max_steps=3, log_model=True), LEVELS, s, track=True, compute=compute_from_params())

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    run = mlflow.search_runs(experiment_names=["test-sft"], output_format="list")[0]
    assert run.info.run_name == "rctp@2" and run.info.status == "FINISHED"  # its DVC stage: rctp@<grid seed>
    assert (run.data.tags["rcgrpo.cell"], run.data.tags["rcgrpo.seed"]) == ("rctp", "2")
    assert run.data.params["sft.learning_rate"] == "0.01"
    assert run.data.params["inputs.data_md5"] == checkpoints.file_md5(s.data)
    assert on_test_device(run.data.params["placement.device"]) and run.data.params["compute.device"] == "auto"
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    for key in ("learning_rate", "grad_norm", "tokens_per_s", "summary/loss_last"):
        assert key in run.data.metrics
    model_uri = next(m.model_uri for m in mlflow.search_logged_models(output_format="list")
                     if m.source_run_id == run.info.run_id)
    model, tok = model_registry.load_logged_model(model_uri)
    ref, _ = models.load_trained(tiny_model_dir, s.out)
    ids = tok(f"hi {HIGH}", return_tensors="pt")
    model.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).logits, ref(**ids).logits)


# ------------------------------------------------------------------------------------------ bad input


def write_params(tmp_path: Path, **sft_section) -> Path:
    section = {"max_steps": 2, "variants": {"sft": {}, "rctp": {"require_reward_token": True}}, **sft_section}
    return committed_with(tmp_path / "params.yaml", {"sft": section, "label_rewards": {"tokens": list(LEVELS)}})


@pytest.mark.parametrize("bad, message", [
    ({"learning_rate": -1e-5}, "learning_rate must be > 0"),
    ({"lora_r": 0}, "lora_r (LoRA rank) must be >= 1"),
    ({"lora_dropout": 1.5}, "lora_dropout must be in [0, 1)"),
    ({"batch_size": 0}, "batch_size and grad_accum must be >= 1"),
    ({"lr": 1e-5}, "unknown key(s) ['lr']"),
    ({"variants": {"rctp": {"lora_r": 0}}}, "sft.variants.rctp: lora_r (LoRA rank) must be >= 1"),
    # the tokens come with the SFT model: an RCTP-from-SFT token init of its own would do nothing
    ({"variants": {"sft": {}, "rctp": {"init": "sft", "reward_token_init": "words"}}},
     "variants.rctp: reward_token_init 'words' does nothing with init sft"),
])
def test_bad_params_fail_before_training(bad, message, datasets, tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    params = write_params(tmp_path, **bad)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        sft_run.load_sft_config(params, "rctp")
    res = CliRunner().invoke(sft_stage.app, ["--variant", "rctp", "--params", str(params), "--model-dir",
                                       str(tiny_model_dir), "--data", str(datasets / "rctp.jsonl"),
                                       "--out", str(tmp_path / "o"), "--checkpoints", str(tmp_path / "ck")])
    assert res.exit_code == 2 and message in res.output
    assert not (tmp_path / "ck").exists() and not (tmp_path / "o").exists()


def test_unknown_variant_and_missing_inputs(datasets, tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    params = write_params(tmp_path)
    with pytest.raises(ConfigError, match="unknown variant 'sftt'"):
        sft_run.load_sft_config(params, "sftt")
    args = ["--variant", "rctp", "--params", str(params), "--out", str(tmp_path / "o"),
            "--checkpoints", str(tmp_path / "ck")]
    res = CliRunner().invoke(sft_stage.app, args + ["--model-dir", str(tiny_model_dir), "--data", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2 and "dataset not found" in res.output and "nope.jsonl" in res.output
    res = CliRunner().invoke(sft_stage.app, args + ["--model-dir", str(tmp_path), "--data", str(datasets / "rctp.jsonl")])
    assert res.exit_code == 2 and "no config.json" in res.output
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(messages=[m for m in r["messages"] if m["role"] != "assistant"]), "no assistant message"),
    (lambda r: r.update(reward_token="<|mid_reward|>"), "not a configured token"),
    (lambda r: r["messages"][1].update(content="no goal"), "does not end with the reward goal"),
    (lambda r: r.update(reward_token=None), "`reward_token` missing"),
    (lambda r: r["messages"][2].update(role="robot"), "messages[2] must be"),
])
def test_bad_rows_name_file_and_row(mutate, message, tmp_path):
    rows = [chat(i, HIGH) for i in range(3)]
    mutate(rows[1])
    write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(InputError, match=rf"d\.jsonl: row 2: .*{message[:12].replace('[', '.').replace('`', '.')}"):
        sft_rows.load_rows(tmp_path / "d.jsonl", LEVELS, require_token=True)


def test_truncation_that_leaves_no_assistant_token_is_an_error(datasets, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = sft_rows.load_rows(datasets / "sft.jsonl", LEVELS, False)
    with pytest.raises(InputError, match="raise sft.max_length"):
        sft_rows.tokenize_rows(rows, tok, max_length=20)
    out, stats = sft_rows.tokenize_rows(rows, tok, max_length=48)
    assert stats["rows_truncated"] == len(rows) and all(len(r["input_ids"]) == 48 for r in out)


def test_balanced_order_and_example_budget(tiny_model_dir):
    from transformers import AutoTokenizer

    rows = [chat(i, HIGH if i < 12 else LOW) for i in range(16)]
    order = sft_rows.balanced_order(rows, seed=0)
    assert sorted(r["reward_token"] for r in order[:8]) == [HIGH] * 4 + [LOW] * 4
    assert sorted(r["trajectory_id"] for r in order) == sorted(r["trajectory_id"] for r in rows)
    assert order == sft_rows.balanced_order(rows, seed=0) and order != sft_rows.balanced_order(rows, seed=1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    long = chat(99, HIGH)
    long["messages"][0]["content"] *= 40  # its first assistant token lies beyond max_length
    out, stats = sft_rows.tokenize_rows([long] + order, tok, max_length=256, limit=5)
    assert len(out) == 5 and stats["rows_dropped_no_assistant"] == 1 and stats["rows_seen"] == 6


def test_untied_embeddings_train_and_restore_both_rows(tiny_model_dir, tmp_path):
    """Qwen-style (untied) heads: the reward rows of the input embedding AND the LM head are in the adapter."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    model.config.tie_word_embeddings = False
    model.save_pretrained(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.save_pretrained(tmp_path / "base")
    ids = reward_tokens.add_reward_tokens(model, tok, LEVELS)
    peft = get_peft_model(model, sft_trainer.lora_config(tiny_sft_config(), model, ids))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(1.0)
    with adapters.small_adapter_saves(peft, tok):
        peft.save_pretrained(tmp_path / "adapter")
    names = {n for n, _ in peft.named_parameters() if "trainable_tokens_delta" in n}
    assert any("lm_head" in n for n in names) and any("embed_tokens" in n for n in names)
    loaded, _ = models.load_trained(tmp_path / "base", tmp_path / "adapter")
    x = torch.tensor([[5, ids[0], 7, ids[1]]])
    peft.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=x).logits, loaded(input_ids=x).logits)


# ------------------------------------------------------------------------------------------ placement


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_effective_batch(datasets, tiny_model_dir, tmp_path):
    """A (fake) CUDA OOM in the first step: retried at half the micro-batch and twice the accumulation, with
    a warning, until it fits; the run then consumes rows exactly as the requested batch would."""
    import torch
    from transformers import TrainerCallback

    from rcgrpo_tasks.engine.device import MemorySplitWarning

    class FakeOOM(TrainerCallback):
        def __init__(self):
            self.sizes = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.sizes.append((args.per_device_train_batch_size, args.gradient_accumulation_steps))
            if args.per_device_train_batch_size > 1:  # only one chat fits
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    cb = FakeOOM()
    s = spec(tmp_path, tiny_model_dir, "rctp", datasets / "rctp.jsonl")
    with pytest.warns(MemorySplitWarning, match="retrying at 2 x 2"):
        summary = sft_run.train_variant(tiny_sft_config(batch_size=4, grad_accum=1, max_steps=2), LEVELS, s, callbacks=[cb],
                                    track=False, compute=compute_from_params())
    assert cb.sizes[:2] == [(4, 1), (2, 2)] and set(cb.sizes[2:]) == {(1, 4)}
    assert summary["micro_batch"] == 1 and summary["grad_accum"] == 4 and summary["steps"] == 2
    assert summary["epochs"] == pytest.approx(2 * 4 / 16)  # 4 chats per step, as requested (not 1)
    assert on_test_device(summary["placement"]["device"]) and summary["placement"]["dtype"] == "float32"
    assert json.loads(s.metrics.read_text())["placement"] == summary["placement"]


def test_cuda_without_cuda_fails_before_training(datasets, tiny_model_dir, tmp_path, monkeypatch):
    import torch
    from typer.testing import CliRunner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    params = write_params(tmp_path)
    data = yaml.safe_load(params.read_text())
    params.write_text(yaml.safe_dump({**data, "compute": {**data["compute"], "device": "cuda"}}))
    res = CliRunner().invoke(sft_stage.app, ["--variant", "rctp", "--params", str(params), "--model-dir",
                                       str(tiny_model_dir), "--data", str(datasets / "rctp.jsonl"),
                                       "--out", str(tmp_path / "o"), "--checkpoints", str(tmp_path / "ck")])
    assert res.exit_code == 2 and "CUDA is not available" in res.output
    assert not (tmp_path / "ck").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4352 vs 4248: "
                 "PytorchStreamWriter failed writing file data/0: file write failed"),
    Exception('Error while serializing: IoError(Os { code: 27, kind: FileTooLarge, message: "File too large" })'),
    OSError(28, "No space left on device"),
])
def test_a_full_disk_names_the_output(tmp_path, error):
    from rcgrpo_tasks.ops.outputs import OutputError

    with pytest.raises(OutputError, match=rf"^{tmp_path}/ckpt: could not be written \(disk full or file too large"):
        with runs.disk_errors(tmp_path / "ckpt"):
            raise error
    with pytest.raises(RuntimeError, match="CUDA error"), runs.disk_errors(tmp_path / "ckpt"):
        raise RuntimeError("CUDA error: device-side assert triggered")  # not a disk problem: unchanged


def test_an_rctp_pair_step_updates_the_same_weights_with_and_without_the_shared_prefix(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """One optimizer step of RCTP pairs (each micro-batch one prompt under both tokens), from the same seed,
    on the CPU, float32: the step's gradients agree within 1e-5 of the largest, and the updated weights
    within 1e-3 of the step wherever Adam's step does not amplify a gradient's rounding
    (`helpers.assert_same_adam_step`)."""
    from rcgrpo_tasks.engine.compute import ComputeConfig

    packed = pack_spy(monkeypatch)
    data = tmp_path / "pairs.jsonl"
    write_jsonl(data, [chat(i, tok) for i in range(4) for tok in (HIGH, LOW)])
    runs_ = {}
    for name, shared in (("plain", None), ("shared", 0)):
        snap, grads = snapshot(), grad_capture()
        cfg = tiny_sft_config(require_reward_token=True, row_order="pairs", batch_size=2, grad_accum=2, max_steps=1,
                              shared_prefix_min_tokens=shared, bf16=False)
        sft_run.train_variant(cfg, LEVELS, spec(tmp_path, tiny_model_dir, "rctp", data, name), callbacks=[snap, grads],
                          track=False, compute=config_from_params(ComputeConfig, "compute", device="cpu"))
        runs_[name] = (snap, grads.grads)
        assert packed == ([] if shared is None else [2, 2])  # each pair's micro-batch took the shared layout
    (plain, g_plain), (shared, g_shared) = runs_["plain"], runs_["shared"]
    assert_same_adam_step(plain, shared, g_plain, g_shared)


def test_an_rctp_run_from_the_base_model_does_not_read_the_sft_adapter(tmp_path):
    """dvc.yaml passes `--init-adapter models/sft/sft` to every RCTP run; `init: base` (the paper profile's RCTP)
    reads the run without it, `init: sft` with it."""
    from dataclasses import replace

    spec = sft_config.SftRun(variant="rctp", model_dir=tmp_path, data=tmp_path / "d.jsonl", out=tmp_path / "o",
                             checkpoints=tmp_path / "c", init_adapter=tmp_path / "sft")
    cfg = sft_run.load_sft_config(str(committed_with(tmp_path / "params.yaml")), "rctp")[0]
    assert spec.reading(replace(cfg, init="sft")).init_adapter == tmp_path / "sft"
    base = spec.reading(replace(cfg, init="base"))
    assert base.init_adapter is None
    plain = replace(cfg, init="base", margin_every=0)
    base.check_against(plain)  # no "--init-adapter given but init is base"
    with pytest.raises(ConfigError, match="init is base"):
        spec.check_against(plain)
