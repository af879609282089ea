"""Exactness checks of a method's gradient: `gcf check SPEC` and tests/test_exactness.py run these.

For a method class and a settings case, on a batch built for its data family (on-policy groups, PPO's
GAE, preference pairs, online pairs, unpaired labels, kept samples, demonstrations) by the method's own
`setup`/`prepare` on a stub trainer, with a policy whose logits are a leaf table LOGITS[row, t, :]:

(a) the engine's gradient (micro-batched `coefficient` + `engine.weighted_loss`, Z from `engine.normaliser`)
    equals autograd of the TEXTBOOK objective (gcfamily/check/textbook.py), and autograd of the method's own
    `objective`;
(b) d loss / d logits through the engine's chunked log-prob backward equals GC * w / Z * (onehot - softmax) / tau
    on every token, GC = (dJ/dlogp) / (w / Z) from the textbook, not from the method's coefficient.

The policy is pi at the sampling temperature tau (log softmax(logits / tau)) for a family that samples, at 1 for
one that does not; the engine's log-probs are at the method's `logprob_temperature()`, so a method that takes
them at another temperature fails (b).

The textbook shares no code with the methods or the engine: advantages (from the rewards), ratios, clips,
KL estimators, GAE, pair losses and the aggregation are restated from the papers there; only data the
trainer would supply (pi_old and pi_ref log-probs, a critic's values, rewards) is shared. What a class is held
to is gcfamily/check/families.py's: the textbook for the library's rules and the hooks it restates; its own
objective, with (b) on that objective's GC, for a class whose coefficient and objective are both its own, or
that has a hook the textbook does not know (named); and a class that overrides only one of coefficient and
objective fails, with a sentence saying the other must change too.

Micro-batches hold unequal counts; a `simulated_ranks` case (RANKS) splits the step over ranks whose all_sum waits
for the others (world.Collective); running state is built over three warm-up steps; pairs come from the method's own
data(); the second model's loss (PPO's critic, the reward model) is checked through its own step (second.py).

Each check counts the branches its batch reached (clipped low and high, the clip-higher band, KL past the
clamp, an equal-reward group, a failed reward, several micro-batches, sampler ratios past tis_max and below
tis_min, ...) and fails when a branch its settings make reachable did not occur: a pass is never a pass on a
batch that could not tell. The on-policy batches carry the sampler's log-probs (check/sampler.py places them), and
the textbook weighs each token's term by TRL's truncated or masked ratio pi_old/pi_sampler where tis is on.
"""

from __future__ import annotations

# the stub world (sizes, rewards, stub trainer and critic), the textbook (with the surrogates other than PPO's clip in
# surrogates.py), the batches, the settings cases (cases.py) and the families (what a class is held to) live in modules
# of their own; running the checks in gradient.py, recording them in
# outcome.py, the text `gcf check` prints in report.py
from gcfamily.check.families import (
    FAMILIES,
    RANKS,
    TAU,
    Family,
    cases,
    family_of,
    own_rule,
    textbook_choices,
    textbook_for,
    unsupported,
)
from gcfamily.check.gradient import check_once, run_case
from gcfamily.check.outcome import Outcome
from gcfamily.check.report import report
from gcfamily.check.world import G, make

__all__ = [
    "FAMILIES",
    "RANKS",
    "TAU",
    "Family",
    "G",
    "Outcome",
    "cases",
    "check_once",
    "family_of",
    "make",
    "own_rule",
    "report",
    "run_case",
    "textbook_choices",
    "textbook_for",
    "unsupported",
]
