"""Methods: the Method API, the one door to the run, and one module per family.

    base.py          Method, Batch: a data source, a prepare step and the gradient coefficient
    services.py      Services, the Protocol a method asks the run through
    registry.py      METHODS, the table of built-in methods, and get_method, the one resolver of a --method spec
    onpolicy.py      prompts -> G sampled completions -> rewards, shared by the on-policy methods
    tis.py           truncated importance sampling against the sampler's log-probs (the on-policy methods' tis setting)
    pools.py         pools of the initial policy's own samples (offline RFT, DPO on the model's own pairs)
    sft.py, dpo.py, rft.py, grpo.py, ppo.py, ...  one family each

The names below are those of the registry; the rest import from their own module (gcfamily.methods.base.Method).
"""

from __future__ import annotations

from gcfamily.methods.registry import (
    ENTRY_POINT_GROUP,
    METHODS,
    SPEC_FORMS,
    all_methods,
    get_method,
    installed_methods,
    method_label,
    resolve,
    setting_names,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "METHODS",
    "SPEC_FORMS",
    "all_methods",
    "get_method",
    "installed_methods",
    "method_label",
    "resolve",
    "setting_names",
]
