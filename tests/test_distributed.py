"""Two processes (gloo, CPU) take the same optimizer steps as one process with the same global batch.

The two-process side runs this file as a script under torchrun (`_worker`, at the bottom): for DDP
and for FSDP2 it trains SFT for 2 steps through `Trainer.run` (each rank reads its half of every
step's examples), resumes the same run from its step-1 checkpoint, and takes 2 GRPO optimizer steps
(mu = 2, so pi_old and pi_ref both come from the wrapped/sharded models) on a FIXED batch of scored
groups, each rank holding two whole groups. The one-process side runs here, and the weights must match.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gcfamily.config import Config
from gcfamily.core.batch import select
from gcfamily.data.batches import collate
from gcfamily.errors import GcfError

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "fsdp2")
G, PROMPTS = 4, 4  # the fixed GRPO batch: 4 groups of 4, two groups per rank
SFT = dict(method="sft", batch_size=4, micro_batch_size=1, max_steps=2, save_every=1, keep_last=2)
GRPO = dict(method="grpo", batch_size=PROMPTS, group_size=G, micro_batch_size=4, mu=2, beta=0.04)
PPO = dict(method="ppo", batch_size=PROMPTS, group_size=G, micro_batch_size=4, mu=2, beta=0.04, critic_lr=1e-3)
ATOL = 1e-5


def _cfg(out: Path, strategy: str = "ddp", **kw) -> Config:
    base = dict(
        model="tiny", task="arithmetic", lr=1e-3, output_dir=str(out), progress=False, strategy=strategy, device="cpu"
    )
    return Config(**{**base, **kw})


def fixed_grpo_batch(tokenizer) -> dict:
    """PROMPTS groups of G completions with fixed rewards: mixed groups and one zero-std group."""
    gen = torch.Generator().manual_seed(0)
    V = len(tokenizer)
    rows = []
    for i in range(PROMPTS):
        prompt = torch.randint(7, V, (3 + i,), generator=gen).tolist()
        for _ in range(G):
            rows.append(
                (prompt, torch.randint(7, V, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist())
            )
    batch = collate(rows, tokenizer.pad_token_id)
    rewards = torch.tensor([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 0, 0.25, 1, 0.75, 1, 1, 0, 0.5])  # group 2 has std 0
    return batch.replaced(
        rewards=rewards, valid=torch.ones(len(rows), dtype=torch.bool), prompt_index=torch.arange(len(rows)) // G
    )


# ----------------------------------------------------------------------------------
# the one-process side, and the comparison


WORKER_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _torchrun(out: Path, *mode: str) -> list[str]:
    """This file under torchrun in 2 processes: `_worker` (no mode) or the named scenario."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        str(out),
        *mode,
    ]


@pytest.fixture(scope="module")
def two_process(tmp_path_factory) -> Path:
    """Run `_worker` in 2 processes under torchrun once for the whole module; its output folder."""
    out = tmp_path_factory.mktemp("two_process")
    res = subprocess.run(_torchrun(out), env=WORKER_ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"two-process worker failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"largest weight difference {worst:.2e}")
    assert worst < ATOL, f"weights differ by up to {worst:.2e}"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sft_two_processes_equal_one(two_process, tmp_path, strategy):
    from gcfamily.run.trainer import Trainer

    one = Trainer(_cfg(tmp_path / "one", **SFT))
    one.run()
    ref = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = two_process / f"sft-{strategy}"
    _assert_same(ref, load_file(str(two / "model.safetensors")))  # rank 0's save_pretrained of the gathered model
    _assert_same(ref, load_file(str(two / "checkpoints" / "step-2" / "model.safetensors")))
    _assert_same(
        ref, load_file(str(two_process / f"sft-{strategy}-resumed" / "model.safetensors"))
    )  # 1 step + resume + 1 step
    # rank 0 logs one row per step for the group: the loss and tokens of the whole global batch, and
    # the same gradient norm (Adam would hide a wrong gradient scale in the weights; the norm does not)
    for a, b in zip(_metrics(tmp_path / "one"), _metrics(two), strict=True):
        assert b["tokens"] == a["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grpo_on_fixed_rollouts_two_processes_equal_one(two_process, tmp_path, strategy):
    from gcfamily.run.trainer import Trainer

    one = Trainer(_cfg(tmp_path, **GRPO))
    metrics = one.train_step(one.method.prepare(fixed_grpo_batch(one.tokenizer))[0])
    ref = {k: v.detach() for k, v in one.unwrapped_policy().state_dict().items()}
    _assert_same(ref, load_file(str(two_process / f"grpo-{strategy}.safetensors")))
    two = json.loads((two_process / f"grpo-{strategy}.json").read_text())  # rank 0's step metrics
    assert metrics["grad_norm"] > 0 and two["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ppo_two_processes_equal_one_and_fsdp2_shards_the_critic(two_process, tmp_path, strategy):
    """PPO's policy and critic after two steps on 2 processes = 1 process (advantages whitened over
    both ranks' tokens); under FSDP2 each rank holds half the critic and of its Adam state; a resume
    from the step-1 checkpoint (whole critic state, split again onto the shards) takes the same step 2."""
    from gcfamily.run.trainer import Trainer

    one = Trainer(_cfg(tmp_path, **PPO))
    first = one.train_step(one.method.prepare(fixed_grpo_batch(one.tokenizer))[0])
    one.train_step(one.method.prepare(fixed_grpo_batch(one.tokenizer))[0])
    ref = {
        **{k: v.detach() for k, v in one.unwrapped_policy().state_dict().items()},
        **{f"critic.{k}": v.detach() for k, v in one.method.critic.state_dict().items()},
    }
    _assert_same(ref, load_file(str(two_process / f"ppo-{strategy}.safetensors")))
    _assert_same(ref, load_file(str(two_process / f"ppo-{strategy}-resumed.safetensors")))
    two = json.loads((two_process / f"ppo-{strategy}.json").read_text())  # rank 0's first step, its own figures
    assert two["ppo/critic_grad_norm"] == pytest.approx(first["ppo/critic_grad_norm"], rel=1e-5)
    share = 0.5 if strategy == "fsdp2" else 1.0
    for key in ("ppo/critic_param_mb", "ppo/critic_optimizer_mb"):
        assert two[key] == pytest.approx(share * first[key], rel=0.01), (key, two[key], first[key])


def test_cli_grpo_fsdp2_writes_a_plain_transformers_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--strategy",
        "fsdp2",
        "--max-steps",
        "2",
        "--output-dir",
        str(out),
        "--set",
        "progress=false",
    ]
    res = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "done: 2 steps on 2 processes (fsdp2)" in res.stdout
    model = AutoModelForCausalLM.from_pretrained(out)  # no torch.distributed involved
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()
    assert [r["step"] for r in _metrics(out)] == [1, 2]  # one log for the group, from rank 0


def test_token_budget_counts_every_rank_and_stops_all_at_one_step(tmp_path):
    """max_tokens counts the tokens of all ranks (the logged budget/tokens is their sum), and every
    rank stops after the same step: a rank that stopped alone would leave the others waiting."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--strategy",
        "ddp",
        "--max-steps",
        "50",
        "--output-dir",
        str(out),
        "--set",
        "progress=false",
        "--set",
        "max_tokens=60",
        "--set",
        "batch_size=4",
    ]
    res = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [r for r in _metrics(out) if "budget/tokens" in r]
    total = 0.0
    for r in rows:
        total += r["tokens"] + r["tokens/generated"]
        assert r["budget/tokens"] == pytest.approx(total)
    assert rows[-1]["budget/tokens"] >= 60 > rows[-2]["budget/tokens"]  # stopped at the first step past the budget
    assert f"done: {rows[-1]['step']} steps on 2 processes (ddp)" in res.stdout


def test_cli_user_error_is_one_line_before_any_process_starts(gcf, tmp_path):
    code, out, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--output-dir",
        str(tmp_path),
        "--set",
        "batch_size=3",
    )
    assert code == 2 and "batch_size=3" in err and "multiple of 2" in err and "Traceback" not in err


def test_sigterm_to_the_launcher_stops_every_rank_at_a_checkpoint(tmp_path):
    """`gcf run --nproc 2` stopped by SIGTERM: one line, exit 143, a resumable checkpoint, no traceback."""
    import signal
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--strategy",
        "ddp",
        "--max-steps",
        "100000",
        "--output-dir",
        str(out),
        "--set",
        "progress=false",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    # wait for training to have started (the stop handlers installed) however long a loaded machine takes; a fixed
    # deadline that then sent SIGTERM anyway raced the start. The limit only guards against a hang
    deadline = time.monotonic() + 1800
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run logged no step in 30 minutes"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "Stopped by SIGTERM" in err.strip().splitlines()[-1], err
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")), "no checkpoint"


def test_a_signal_after_the_ranks_agreed_waits_for_the_next_step(tmp_path):
    """A signal that lands on one rank between the stop agreement and the stop check must not make
    that rank alone save and leave (the other would wait in the next step's collective forever)."""
    out = tmp_path / "late-signal"
    proc = subprocess.Popen(
        _torchrun(out, "late-signal"),
        env=WORKER_ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and both ranks
        proc.communicate()
        pytest.fail("the two processes hung: one rank stopped on its own and the other waited in a collective")
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-6000:]}"
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in ranks] == [2, 2], ranks
    assert all(r["stopped"] and r["stopped"].startswith("Stopped by SIGTERM at step 2") for r in ranks), ranks
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


def test_a_rank_that_loses_its_peer_says_so_in_one_line(tmp_path):
    """Rank 0 is killed mid-run: rank 1's failed collective is one line, not a traceback."""
    res = subprocess.run(
        _torchrun(tmp_path / "run", "rank-0-dies"),
        env=WORKER_ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert "error: process 1 lost its connection to another process, which stopped first" in res.stderr, res.stderr[
        -6000:
    ]
    assert "RuntimeError" not in res.stderr, res.stderr[-6000:]


def test_a_rank_killed_by_a_signal_is_named_by_its_signal():
    from gcfamily.run.launch import signal_name

    assert signal_name(9) == "SIGKILL" and signal_name(15) == "SIGTERM"
    assert signal_name(200) == "signal 200"


def test_step_indices_split_the_global_batch_by_rank():
    from gcfamily.methods.base import Method

    def share(rank: int, world: int) -> list[int]:
        m = Method(Config(batch_size=6, seed=3))
        m.services = types.SimpleNamespace(rank=rank, world_size=world)
        return m.step_indices(50, 4)

    whole = share(0, 1)
    assert share(0, 2) + share(1, 2) == whole  # contiguous shares: a prompt's group never straddles ranks
    assert share(0, 3) + share(1, 3) + share(2, 3) == whole


def test_checkpoint_resumes_only_on_the_process_count_that_wrote_it():
    from gcfamily.run.distributed_save import local_state
    from gcfamily.run.launch import strip_nproc

    two = {"rng": "r0", "rank_rng": ["r0", "r1"]}
    env = types.SimpleNamespace(rank=1, world_size=2)
    assert local_state(two, env)["rng"] == "r1"
    with pytest.raises(GcfError, match="--nproc 2"):
        local_state(two, None)
    with pytest.raises(GcfError, match="one process"):
        local_state({"rng": "r0"}, env)
    assert strip_nproc(["run", "--nproc", "2", "--max-steps", "3", "--nproc=4"]) == ["run", "--max-steps", "3"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_bf16_mixed_precision_on_one_gpu(tmp_path):
    """One NCCL process: float32 master weights sharded by FSDP2, bfloat16 forward, backward and sampling."""
    import socket

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from gcfamily.run.distributed import DistEnv
    from gcfamily.run.trainer import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=dev)
    env = DistEnv(0, 1, 0, dev)
    try:
        tr = Trainer(
            _cfg(
                tmp_path,
                "fsdp2",
                device="cuda",
                method="grpo",
                batch_size=2,
                group_size=4,
                max_new_tokens=8,
                max_steps=2,
            ),
            dist_env=env,
        )
        assert env.compute_dtype == torch.bfloat16 and tr.dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in tr.policy.parameters())  # the shards the optimizer steps
        tr.run()
        assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
        env.close(agree=True)
    finally:
        env.close()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert next(model.parameters()).dtype == torch.float32  # the master weights
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


# ----------------------------------------------------------------------------------
# the two-process side (this file run as a script under torchrun)


def _worker(out: Path) -> None:
    torch.set_num_threads(1)
    from gcfamily.run.distributed import DistEnv
    from gcfamily.run.trainer import Trainer

    env = DistEnv.from_env("cpu")
    assert env is not None and env.world_size == 2
    try:
        for strategy in STRATEGIES:
            Trainer(_cfg(out / f"sft-{strategy}", strategy, **SFT), dist_env=env).run()
            resumed = Trainer(
                _cfg(out / f"sft-{strategy}-resumed", strategy, **SFT),
                resume=str(out / f"sft-{strategy}" / "checkpoints" / "step-1"),
                dist_env=env,
            )
            assert resumed.step == 1
            resumed.run()

            tr = Trainer(_cfg(out / f"grpo-{strategy}", strategy, **GRPO), dist_env=env)
            batch = fixed_grpo_batch(tr.tokenizer)
            per = len(batch.input_ids) // env.world_size
            metrics = tr.train_step(tr.method.prepare(select(batch, slice(env.rank * per, (env.rank + 1) * per)))[0])
            weights = env.full_state_dict(tr.unwrapped_policy())
            if env.is_main:
                save_file(weights, str(out / f"grpo-{strategy}.safetensors"))
                (out / f"grpo-{strategy}.json").write_text(json.dumps(metrics))
            _ppo_worker(out, strategy, env)
        env.close(agree=True)  # both ranks finished: a barrier before the connections close
    finally:
        env.close()


def _ppo_worker(out: Path, strategy: str, env) -> None:
    """Two PPO steps on the fixed batch (each rank its half), a checkpoint after the first, and a
    resume from it that takes the second step again: policy and critic weights of both."""
    from gcfamily.run.trainer import Trainer

    def share(tr) -> dict:
        batch = fixed_grpo_batch(tr.tokenizer)
        per = len(batch.input_ids) // env.world_size
        return select(batch, slice(env.rank * per, (env.rank + 1) * per))

    def weights(tr) -> dict:
        return {
            **env.full_state_dict(tr.unwrapped_policy()),
            **{f"critic.{k}": v for k, v in env.full_state_dict(tr.method.critic).items()},
        }

    tr = Trainer(_cfg(out / f"ppo-{strategy}", strategy, **PPO), dist_env=env)
    first = tr.train_step(tr.method.prepare(share(tr))[0])
    tr.step = 1
    tr.save_checkpoint()
    tr.train_step(tr.method.prepare(share(tr))[0])
    two_steps = weights(tr)
    resumed = Trainer(
        _cfg(out / f"ppo-{strategy}-resumed", strategy, **PPO),
        resume=str(out / f"ppo-{strategy}" / "checkpoints" / "step-1"),
        dist_env=env,
    )
    resumed.train_step(resumed.method.prepare(share(resumed))[0])
    again = weights(resumed)
    if env.is_main:
        save_file(two_steps, str(out / f"ppo-{strategy}.safetensors"))
        save_file(again, str(out / f"ppo-{strategy}-resumed.safetensors"))
        (out / f"ppo-{strategy}.json").write_text(json.dumps(first))


def _late_signal_on_rank_0(out: Path, env) -> None:
    """Rank 0 gets SIGTERM at step 1 after the ranks agreed not to stop (while it logs); rank 1 never does."""
    import signal

    from gcfamily.errors import Interrupted
    from gcfamily.run.trainer import Trainer

    tr = Trainer(_cfg(out, "ddp", **{**SFT, "max_steps": 4, "save_every": 0, "log_every": 1}), dist_env=env)
    if env.is_main:
        log = tr.logger.log

        def log_then_signal(step, metrics):
            log(step, metrics)
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

        tr.logger.log = log_then_signal
    try:
        tr.run()
        stopped = None
    except Interrupted as e:
        stopped = str(e)
    (out / f"rank-{env.rank}.json").write_text(json.dumps({"step": tr.step, "stopped": stopped}))


def _rank_0_dies(out: Path) -> None:
    """`gcf run` in each rank (launch.run_process), rank 0 killed by SIGKILL during step 2."""
    import signal

    from gcfamily.run.launch import run_process
    from gcfamily.run.trainer import Trainer

    if os.environ["RANK"] == "0":
        step = Trainer.train_step

        def dying_step(self, batch):
            if self.step == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self, batch)

        Trainer.train_step = dying_step
    run_process(_cfg(out, "ddp", **{**SFT, "max_steps": 4}), None)


if __name__ == "__main__":
    if sys.argv[2:] == ["rank-0-dies"]:
        torch.set_num_threads(1)
        _rank_0_dies(Path(sys.argv[1]))
    elif sys.argv[2:] == ["late-signal"]:
        torch.set_num_threads(1)
        from gcfamily.run.distributed import DistEnv

        dist_env = DistEnv.from_env("cpu")
        try:
            _late_signal_on_rank_0(Path(sys.argv[1]), dist_env)
            dist_env.close(agree=True)
        finally:
            dist_env.close()
    else:
        _worker(Path(sys.argv[1]))
    from gcfamily.run.launch import leave

    leave(0)  # as a rank of `gcf run --nproc` ends: no interpreter finalization after the group is left
