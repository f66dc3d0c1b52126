"""vLLM executed (marker `vllm`; runs in the CPU vLLM environment, `make vllm-venv && make test-vllm`).

The `vllm` backend must decode what the `hf` backend decodes: greedy rollouts of real BFCL entries through
the engine loop (`run_groups`), token for token, with the same results and verdicts, for the base model,
a plain LoRA adapter (vLLM `LoRARequest`) and an adapter with reward tokens (merged first). Sampled rows
are seeded per row, so a rollout does not depend on its batch, and their log-probs are those of the
temperature-scaled distribution the `hf` backend records. The model is a tiny random Llama with SmolLM2's
tokenizer, head size 32 (vLLM's CPU attention starts there), weights large enough that greedy choices are
not near-ties. Each vLLM engine costs ~30-60 s to start on 2 cores, so engines are shared per module.
"""

from __future__ import annotations

import os

import pytest
from helpers import HIGH, LEVELS, compute_from_params, config_from_params

pytest.importorskip("vllm", reason="needs vLLM: the CPU vLLM environment (`make vllm-venv`, then `make test-vllm`)")
pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rcgrpo_tasks.engine.backend import SamplingParams  # noqa: E402
from rcgrpo_tasks.engine.hf import HFBackend  # noqa: E402
from rcgrpo_tasks.engine.rollout import run_groups  # noqa: E402
from rcgrpo_tasks.engine.vllm import VLLMBackend, adapter_needs_merge  # noqa: E402
from rcgrpo_tasks.env.multi_turn import entries as multi_turn  # noqa: E402
from rcgrpo_tasks.env.prompt import PromptConfig  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=4096, enforce_eager=True)
"""Tests start engines eagerly: torch.compile would add minutes for a 2-layer model."""
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory, tokenizer_dir):
    """A 2-layer random Llama, head size 32, SmolLM2's tokenizer; init std 0.1 keeps top logits apart."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("vllm_tiny")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.1, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def _lora(model_dir, out, reward_tokens: bool):
    """A PEFT LoRA with random (non-zero) B; with `reward_tokens`, the sft stage's kind: the reward tokens
    added, their embedding rows trained as PEFT trainable tokens, the tokenizer saved beside it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo.tokens import add_reward_tokens
    from rcgrpo_tasks.train.common.adapters import small_adapter_saves

    torch.manual_seed(1)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    extra = {}
    if reward_tokens:
        ids = add_reward_tokens(model, tok, LEVELS, init="apart", levels=LEVELS)
        extra["trainable_token_indices"] = ids  # tied embeddings: the input rows serve the LM head too
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False, **extra))
    with torch.no_grad():
        for name, prm in peft.named_parameters():
            if "lora_B" in name:
                prm.normal_(0, 0.2)
    with small_adapter_saves(peft, tok if reward_tokens else None):
        peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_dir(vllm_model_dir, tmp_path_factory):
    return _lora(vllm_model_dir, tmp_path_factory.mktemp("lora"), reward_tokens=False)


@pytest.fixture(scope="module")
def engine(vllm_model_dir, lora_dir):
    """One vLLM engine for the module: the tiny model with the plain LoRA as its request."""
    backend = VLLMBackend(vllm_model_dir, lora_dir, **ENGINE)
    yield backend
    backend.close()


def _groups(n_entries: int = 3, g: int = 2, token: str | None = None):
    entries = multi_turn.load_entries()
    picked = [entries[(i * 200 + 7 * i) % len(entries)] for i in range(n_entries)]  # across categories
    return [(e, [token] * g) for e in picked]


def _rollouts(backend, groups, protocol="official", sampling=GREEDY, batch_rows=None):
    proto = config_from_params(PromptConfig, "prompt", protocol=protocol, system_prompt="short").protocol_config(2)
    return [t for group in run_groups(backend, groups, proto, sampling, batch_rows=batch_rows) for t in group]


def assert_same_rollouts(ours, theirs, lp_tol: float = 1e-3) -> None:
    """Token for token, with results, verdicts and terminations; log-probs within `lp_tol`."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        assert a.token_ids == b.token_ids, f"{a.entry_id}: first divergence at token {first} of {len(a.token_ids)}"
        assert (a.result, a.score, a.termination, a.completion_mask) == (b.result, b.score, b.termination,
                                                                         b.completion_mask)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < lp_tol


def model_logprobs(trajs) -> list[float]:
    """The recorded log-probs of every model-sampled token, in order."""
    return [lp for t in trajs for lp, m in zip(t.logprobs, t.completion_mask) if m]


def teacher_logprobs(model, trajs, temperature: float = 1.0) -> list[float]:
    """What `model` (float32, one forward per trajectory) gives the same tokens, temperature-scaled."""
    import torch

    out = []
    with torch.no_grad():
        for t in trajs:
            logits = model(torch.tensor([t.token_ids])).logits[0, :-1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            out += [float(logp[i - 1, t.token_ids[i]]) for i, m in enumerate(t.completion_mask) if m]
    return out


@pytest.mark.parametrize("protocol", ["official", "paper"])
def test_greedy_rollouts_equal_the_hf_backend(engine, vllm_model_dir, protocol):
    base = VLLMBackend.from_llm(engine.llm, engine.tokenizer, model=str(vllm_model_dir))
    hf = HFBackend(vllm_model_dir, device="cpu")
    groups = _groups()
    ours, theirs = _rollouts(base, groups, protocol), _rollouts(hf, groups, protocol)
    assert sum(t.n_model_tokens for t in ours) > len(ours)  # the model did decode
    assert_same_rollouts(ours, theirs)


def test_lora_request_decodes_like_the_merged_hf_adapter(engine, vllm_model_dir, lora_dir):
    assert engine.lora is not None and engine.describe()["adapter"] == str(lora_dir)
    groups = _groups(2)
    ours, theirs = _rollouts(engine, groups), _rollouts(HFBackend(vllm_model_dir, lora_dir, device="cpu"), groups)
    assert_same_rollouts(ours, theirs)
    base = _rollouts(VLLMBackend.from_llm(engine.llm, engine.tokenizer), groups)
    assert [t.token_ids for t in base] != [t.token_ids for t in ours]  # the adapter was applied


def test_sampled_rows_do_not_depend_on_their_batch_and_log_probs_are_temperature_scaled(engine, vllm_model_dir):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=12, seed=3)
    groups = _groups(3, g=3)
    together = _rollouts(engine, groups, sampling=sampling)
    alone = _rollouts(engine, groups[1:2], sampling=sampling)
    assert [t.token_ids for t in together[3:6]] == [t.token_ids for t in alone]
    assert len({tuple(t.token_ids) for t in alone}) > 1  # rows of a group sample apart
    hf = HFBackend(vllm_model_dir, engine.describe()["adapter"], device="cpu")  # the model that sampled
    ours, theirs = model_logprobs(alone[:1]), teacher_logprobs(hf.model, alone[:1], sampling.temperature)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3


def test_seeded_rows_past_one_step_budget(engine):
    """More prompt tokens than one engine step takes (4096 here): with chunked prefill a seeded request split
    across steps kills vLLM's CPU engine ("CPU Generator does not use offset"); whole prompts per step do not."""
    groups = _groups(8, g=2)
    trajs = _rollouts(engine, groups, sampling=SamplingParams(temperature=0.7, max_new_tokens=4, seed=2))
    assert sum(t.prompt_len for t in trajs) > 4096 and len(trajs) == 16


def test_reward_token_adapter_is_merged_and_decodes_like_hf(vllm_model_dir, lora_dir, tmp_path):
    adapter = _lora(vllm_model_dir, tmp_path / "rctp", reward_tokens=True)
    assert adapter_needs_merge(adapter, vllm_model_dir) and not adapter_needs_merge(lora_dir, vllm_model_dir)
    ours_backend = VLLMBackend(vllm_model_dir, adapter, **ENGINE)
    assert ours_backend.lora is None and ours_backend.describe()["adapter"] == str(adapter)
    groups = _groups(2, token=HIGH)
    ours = _rollouts(ours_backend, groups, protocol="paper")
    assert_same_rollouts(ours, _rollouts(HFBackend(vllm_model_dir, adapter, device="cpu"), groups, protocol="paper"))
    high = ours_backend.tokenizer.convert_tokens_to_ids(HIGH)
    assert all(high in t.token_ids[:t.prompt_len] for t in ours)
    ours_backend.close()


# ---------------------------------------------------------------- TRL's two vLLM modes


def serve_command(model_dir, port: int) -> list[str]:
    """`trl vllm-serve`'s own server command (TRL builds it: weight-transfer engine, processed log-probs), run
    through vLLM's API-server module: the `vllm` CLI that `trl vllm-serve` execs reads the version of an
    installed distribution named `vllm`, and the CPU build is installed as `vllm-cpu`."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=str(model_dir), host="127.0.0.1", port=port, enforce_eager=True,
                                        max_model_len=4096, dtype="float32"))
    at = cmd.index("serve")
    return [cmd[0], "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[at + 1], *cmd[at + 2:]]


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    """The server on a free loopback port, with TRL's client connected (it waits for /health)."""
    import signal
    import socket
    import subprocess

    from trl.generation.vllm_client import VLLMClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(vllm_model_dir, port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        yield VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=240)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_trl_vllm_server_decodes_like_the_hf_backend(server, vllm_model_dir):
    from transformers import AutoTokenizer

    from rcgrpo_tasks.engine.vllm import VLLMServerBackend

    backend = VLLMServerBackend(server, AutoTokenizer.from_pretrained(vllm_model_dir), max_positions=4096)
    groups = _groups()
    assert_same_rollouts(_rollouts(backend, groups), _rollouts(HFBackend(vllm_model_dir, device="cpu"), groups))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    first, again = (_rollouts(backend, groups[:1], sampling=sampling) for _ in range(2))
    assert [t.token_ids for t in first] == [t.token_ids for t in again]  # seeded per row
    assert first[0].token_ids != first[1].token_ids  # and apart within the group


@pytest.mark.parametrize("init,algo", [("sft", "grpo"), ("rctp", "rc_grpo")])
def test_one_rl_step_through_trl_colocate(vllm_model_dir, tmp_path, monkeypatch, init, algo):
    """GRPO / RC-GRPO with `use_vllm` / `colocate`: TRL starts vLLM inside the trainer (on the merged init
    written to disk: from an adapter with reward tokens, the base folder's vocabulary would be too small), the
    engine's vLLM backend rolls out on it, the policy's weights reach it (`build_trainer`: vLLM's in-place
    reload, PEFT's trainable-token deltas left out: RC-GRPO trains the reward-token rows), and after training
    the engine decodes what the saved policy decodes with the hf backend."""
    from rcgrpo_tasks.ops.outputs import write_json, write_jsonl
    from rcgrpo_tasks.train.rl import config as rl_config
    from rcgrpo_tasks.train.rl import rollout as rl_rollout
    from rcgrpo_tasks.train.rl import run as rl_run
    from rcgrpo_tasks.train.rl import trainer as rl_trainer

    entries = multi_turn.load_entries(["base"])[:4]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {"train": [e.id for e in entries[:2]], "test": [e.id for e in entries[2:]]})
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # TRL sets them for vLLM:
        monkeypatch.setenv(var, "")  # recorded, so the test leaves them as it found them
        monkeypatch.delenv(var)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test-vllm-colocate")
    box = {}
    real_build, real_groups = rl_run.build_trainer, rl_rollout.EngineRollout.groups

    def build(*a, **k):
        box["trainer"], resume, rollout = real_build(*a, **k)
        return box["trainer"], resume, rollout

    def groups(self, *a, **k):  # a random model never succeeds: alternate rewards so the policy moves
        out = real_groups(self, *a, **k)
        box.setdefault("backends", []).extend(t.provenance["backend"]["backend"] for g in out for t in g)
        for g in out:
            for i, t in enumerate(g):
                t.score = {**t.score, "paper_reward": float(i % 2 == 0)}
        return out

    monkeypatch.setattr(rl_run, "build_trainer", build)
    monkeypatch.setattr(rl_rollout.EngineRollout, "groups", groups)
    cfg = config_from_params(rl_config.RLConfig, "rl", **dict(
        num_generations=2, batch_size=2, micro_batch_size=2, max_steps=2, learning_rate=5e-2, beta=0.0,
        max_new_tokens=6, max_outputs=2, categories=("base",), max_entries=2, lora_r=4, lora_alpha=8,
        save_steps=1, bf16=False, use_vllm=True, vllm_mode="colocate", extra={"vllm_max_model_length": 4096}))
    protocol = config_from_params(PromptConfig, "prompt", system_prompt="short").protocol_config(2)
    adapter = _lora(vllm_model_dir, tmp_path / "rctp", reward_tokens=True) if init == "rctp" else None
    spec = rl_trainer.RLRun(init=init, algo=algo, model_dir=vllm_model_dir, adapter_dir=adapter,
                              entries=tmp_path / "entries.jsonl", split=tmp_path / "split.json", out=tmp_path / "out",
                              checkpoints=tmp_path / "ckpt", metrics=tmp_path / "metrics.json",
                              plots=tmp_path / "diag.tsv")
    summary = rl_run.train_rl(cfg, protocol, LEVELS, spec, compute=compute_from_params())
    assert summary["steps"] == 2 and set(box["backends"]) == {"vllm"}
    gen = box["trainer"].vllm_generation
    gen.sync_weights()  # the trained policy, as the next step would sample from it
    # TRL passes vLLM no dtype and vLLM's `auto` runs a float32 checkpoint in bf16 on any x86 CPU, so greedy
    # tokens may part from a float32 decode at near-ties: compare log-probs of the engine's own tokens.
    ours = _rollouts(VLLMBackend.from_llm(gen.llm, box["trainer"].processing_class),
                     _groups(2, token=HIGH if adapter else None))
    sampled = model_logprobs(ours)
    trained, start = (teacher_logprobs(HFBackend(d, a, device="cpu").model, ours)
                      for d, a in ((spec.out, None), (vllm_model_dir, adapter)))
    err_trained, err_init = (max(abs(a - b) for a, b in zip(sampled, ref)) for ref in (trained, start))
    assert err_trained < 0.1 < err_init, (err_trained, err_init)  # the engine holds the trained policy
