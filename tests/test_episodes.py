"""The episode runner (gcfamily/methods/episodes.py) against a scripted sampler: the episode's tokens are the prompt, each
turn exactly as sampled and each environment answer exactly as the chat template renders it; the policy mask covers
the sampled tokens and nothing else; limits end episodes as documented; an environment that fails fails its episode
only; and scoring adds the step rewards to the final reward (methods/samples.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gcfamily.data.encoding import Formatter
from gcfamily.envs import Environment, Step
from gcfamily.envs.worker import open_envs
from gcfamily.methods.episodes import EpisodeLimits, run_episodes
from gcfamily.models.tiny import tiny_tokenizer
from gcfamily.rollout import Rollout, SamplingSettings

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id


class Script:
    """A stand-in rollout backend: row r of call c writes the turn `turn(c, r)`, ended by EOS unless told otherwise;
    it records what it was asked and what it returned."""

    def __init__(self, turns: dict[tuple[int, int], tuple[str, str]] | None = None) -> None:
        self.turns = turns or {}
        self.calls: list[dict[str, Any]] = []

    def __call__(self, prompt_ids: list[list[int]], G: int, sampling: SamplingSettings) -> Rollout:
        c = len(self.calls)
        contexts = [p for p in prompt_ids for _ in range(G)]
        texts, ended, ids = [], [], []
        for r in range(len(contexts)):
            text, why = self.turns.get((c, r), (f"t{c}r{r}", "eos"))
            t = TOK(text, add_special_tokens=False)["input_ids"][: sampling.max_new_tokens]
            if why == "eos" and len(t) < sampling.max_new_tokens:
                t = t + [EOS]
            texts.append(text)
            ended.append(why)
            ids.append(t)
        P, C = max(map(len, contexts)), max(map(len, ids))
        N = len(contexts)
        input_ids = torch.full((N, P + C), TOK.pad_token_id)
        attention, mask, logps = (torch.zeros(N, P + C, dtype=torch.long) for _ in range(3))
        logps = logps.float()
        for r, (p, t) in enumerate(zip(contexts, ids)):
            input_ids[r, P - len(p) : P] = torch.tensor(p)
            input_ids[r, P : P + len(t)] = torch.tensor(t)
            attention[r, P - len(p) : P + len(t)] = 1
            mask[r, P : P + len(t)] = 1
            logps[r, P : P + len(t)] = -torch.arange(1, len(t) + 1) / (100 * (c + 1))  # a turn's own log-probs
        self.calls.append({"contexts": contexts, "G": G, "sampling": sampling, "ids": ids})
        return Rollout(
            input_ids,
            attention,
            mask,
            logps,
            torch.tensor([w == "length" for w in ended]),
            mask.sum(-1),
            texts,
            torch.arange(N) // G,
            ended,
            {"rollout/push_s": 0.0},
        )


class Echo(Environment):
    """Answers each turn with "seen <turn>" until its row's `turns` turns; a step reward of 0.1 per turn; final 1."""

    role = "tool"
    stop = ("</call>",)

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__(row)
        self.n = 0

    def step(self, turn: str) -> Step:
        self.n += 1
        if "raise" in turn:
            raise RuntimeError("the tool broke")
        if "garbage" in turn:
            return {"not": "a step"}
        return Step(f"seen {turn}", 0.1, self.n >= self.row["turns"])

    def reward(self) -> float:
        return 1.0


ROWS = [{"prompt": "one", "turns": 3}, {"prompt": "two", "turns": 1}]


def run(script: Script, rows=ROWS, G: int = 2, limits: EpisodeLimits | None = None, env: Any = Echo, fmt=None):
    fmt = fmt or Formatter(TOK, "chat")
    envs = open_envs(env)
    prompts = [fmt.prompt_ids(r["prompt"]) for r in rows]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=16, stop_strings=("STOP",))
    out = run_episodes(script, fmt, envs, prompts, rows, G, sampling, limits or EpisodeLimits(4, 200), pad_id=0)
    return out, prompts, fmt


def test_an_episode_is_its_prompt_its_turns_as_sampled_and_the_templates_answers_with_the_policy_mask_on_turns_only():
    script = Script()
    out, prompts, fmt = run(script)
    ro = out.rollout
    # the first call is the single-turn call: every prompt's G samples at once, the env's stop strings added
    assert script.calls[0]["G"] == 2 and script.calls[0]["contexts"] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert script.calls[0]["sampling"].stop_strings == ("STOP", "</call>")
    assert [len(c["contexts"]) for c in script.calls] == [4, 2, 2]  # prompt 0's episodes take three turns
    for k, ep in enumerate(out.episodes):
        want_ids, want_mask, want_logps = list(prompts[k // 2]), [0] * len(prompts[k // 2]), []
        turns = 3 if k < 2 else 1
        for c in range(turns):
            r = k if c == 0 else k  # rows of later calls: the episodes still running, in order (k < 2 here)
            turn = script.calls[c]["ids"][r]
            want_ids += turn
            want_mask += [1] * len(turn)
            want_logps += [-(j + 1) / (100 * (c + 1)) for j in range(len(turn))]
            if c < turns - 1:
                # the environment's answer: what the template writes after the turn, the turn's own EOS left out
                obs = fmt.observation_ids(ROWS[k // 2]["prompt"], f"seen t{c}r{r}", "tool", True)
                assert TOK.decode(obs).startswith("\n<|tool|>seen t")  # rendered by the template, not the raw text
                want_ids += obs
                want_mask += [0] * len(obs)
        on = ro.attention_mask[k].bool()
        assert ro.input_ids[k][on].tolist() == want_ids
        assert ro.completion_mask[k][on].tolist() == want_mask  # env tokens and the prompt are off, every turn token on
        assert ro.sample_logps[k][ro.completion_mask[k].bool()].tolist() == pytest.approx(want_logps)
        assert ep.ended_by == "done" and ep.error is None
        assert [t["role"] for t in ep.turns] == (["assistant", "tool"] * turns)[: 2 * turns - 1]
    # the contexts of the later turns are exactly the episode so far (token in, token out)
    assert (
        script.calls[1]["contexts"][0]
        == ro.input_ids[0][ro.attention_mask[0].bool()].tolist()[: len(script.calls[1]["contexts"][0])]
    )
    assert out.stats["episode/turns_mean"] == pytest.approx((3 + 3 + 1 + 1) / 4)
    assert out.finals == [1.0] * 4
    # step rewards sit on the last token of each turn the environment answered
    ep = out.episodes[0]
    ends = [i for i, (_, lp) in enumerate(ep.pieces) if lp is not None]
    want = [sum(len(ids) for ids, _ in ep.pieces[: i + 1]) - 1 for i in ends]
    assert [at for at, _ in ep.steps] == want and [s for _, s in ep.steps] == [0.1] * 3


def test_in_raw_format_the_answer_is_the_observation_text_itself():
    script = Script()
    out, prompts, fmt = run(script, fmt=Formatter(TOK, "raw"))
    pieces = out.episodes[0].pieces
    assert TOK.decode(pieces[1][0]) == "seen t0r0" and pieces[1][1] is None


def test_an_environment_that_raises_or_answers_garbage_fails_its_episode_only():
    script = Script({(0, 1): ("raise", "eos"), (0, 2): ("garbage", "eos")})
    out, _, _ = run(script)
    errors = [ep.error for ep in out.episodes]
    assert "RuntimeError: the tool broke" in errors[1] and "not a Step" in errors[2]
    assert errors[0] is None and errors[3] is None
    assert out.episodes[0].ended_by == "done" and len(script.calls) == 3  # episode 0 went on alone
    assert out.finals[1] is None and out.stats["episode/failed"] == 2


def test_a_turn_that_hits_max_new_tokens_ends_its_episode_unseen_by_the_environment():
    script = Script({(0, 0): ("x" * 40, "length")})
    out, _, _ = run(script)
    ep = out.episodes[0]
    assert ep.ended_by == "length" and ep.truncated and len(ep.pieces) == 1 and ep.steps == []
    assert bool(out.rollout.truncated[0]) and not bool(out.rollout.truncated[1])


def test_max_turns_and_the_token_room_end_episodes_and_a_long_answer_is_cut_to_the_room_left():
    out, _, _ = run(Script(), limits=EpisodeLimits(max_turns=2, max_episode_tokens=200))
    assert [ep.ended_by for ep in out.episodes] == ["turns", "turns", "done", "done"]
    assert [sum(lp is not None for _, lp in ep.pieces) for ep in out.episodes] == [2, 2, 1, 1]

    class Long(Echo):
        def step(self, turn: str) -> Step:
            return Step("y" * 100)

    out, _, _ = run(Script(), rows=[{"prompt": "p", "turns": 9}], G=1, limits=EpisodeLimits(4, 40), env=Long)
    ep = out.episodes[0]
    assert ep.used <= 40 and out.stats["episode/obs_truncated"] >= 1
    assert ep.ended_by == "tokens" and ep.pieces[-1][1] is not None  # the cut answer left the policy a last turn


def test_the_worker_runs_a_user_file_and_a_hang_fails_that_episode_within_the_timeout(tmp_path):
    f = tmp_path / "envfile.py"
    f.write_text(
        "import time\n"
        "from gcfamily.envs import Environment, Step\n"
        "class Slow(Environment):\n"
        "    def step(self, turn):\n"
        "        if 'r1' in turn:\n"
        "            time.sleep(60)\n"
        "        return Step(done=True)\n"
        "    def reward(self):\n"
        "        return 0.5\n"
    )
    envs = open_envs(f"{f}:Slow", timeout=1.0)
    try:
        fmt = Formatter(TOK, "chat")
        prompts = [fmt.prompt_ids("p")]
        out = run_episodes(
            Script(), fmt, envs, prompts, [{"prompt": "p"}], 2, SamplingSettings(max_new_tokens=8), EpisodeLimits()
        )
    finally:
        envs.close()
    assert out.finals == [0.5, None]
    assert "did not return within env_timeout=1 s" in out.episodes[1].error


def test_an_environment_spec_that_is_no_environment_is_one_sentence(tmp_path):
    from gcfamily.errors import GcfError

    f = tmp_path / "notenv.py"
    f.write_text("class Plain:\n    pass\n")
    with pytest.raises(GcfError, match="not a subclass of gcfamily.envs.Environment"):
        open_envs(f"{f}:Plain")
    with pytest.raises(GcfError, match="does not exist"):
        open_envs(f"{tmp_path}/missing.py:X")
    with pytest.raises(GcfError, match="neither a built-in"):
        open_envs("nosuchenv")


def test_gcf_check_fails_a_normaliser_that_counts_the_environments_tokens(monkeypatch):
    """A planted bug: Z counted as each row's span from its first to its last loss token, so an environment's answer
    inside an episode is counted. Only the multi-turn case can see it, and it does."""
    from gcfamily.check import run_case
    from gcfamily.check.cases import EPISODES
    from gcfamily.core import engine
    from gcfamily.methods import get_method

    settings = {EPISODES: True, "mu": 2, "beta": 0.04, "loss_norm": "token"}
    grpo = get_method("grpo")
    assert run_case(grpo, "multi-turn", settings).ok  # as shipped

    honest = engine.normaliser

    def span(batches, mode, norm_constant=1.0, group=None):
        if mode != "token":
            return honest(batches, mode, norm_constant, group)
        z = 0.0
        for b in batches:
            m = engine.effective_mask(b)
            for row in m:
                on = row.nonzero().flatten()
                z += float(on[-1] - on[0] + 1) if len(on) else 0.0
        return max(z, 1e-12)

    monkeypatch.setattr(engine, "normaliser", span)
    assert not run_case(grpo, "multi-turn", settings).ok
    assert run_case(grpo, "single-turn", {k: v for k, v in settings.items() if k != EPISODES}).ok  # blind to it there


def test_a_later_turn_never_runs_past_its_own_episodes_room():
    """Turn 2 is sampled for episodes with different rooms left: each keeps at most its own room (its turn then ends
    by length, its text the kept tokens'), as if sampled with that room as max_new_tokens."""
    long_first = {(0, 0): ("a" * 9, "eos")}  # episode 0 used 10 tokens in turn 1, the others 5 each
    out, _, _ = run(Script({**long_first, (1, 0): ("b" * 12, "eos"), (1, 1): ("c" * 3, "eos")}),
                    rows=[{"prompt": "p", "turns": 3}], G=2, limits=EpisodeLimits(3, 30))  # fmt: skip
    for ep in out.episodes:
        assert ep.used <= 30
    cut = out.episodes[0]
    assert cut.ended_by == "length" and cut.truncated and cut.used == 30
    assert cut.last_text == TOK.decode(cut.last_ids, skip_special_tokens=True) and set(cut.last_text) == {"b"}
    whole = TOK("ccc", add_special_tokens=False)["input_ids"] + [EOS]
    assert out.episodes[1].pieces[2][0] == whole  # the other had room for its whole turn, EOS included
