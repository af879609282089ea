"""gcfamily: one engine for the gradient-coefficient family of post-training methods.

    import gcfamily as gcf
    run_dir = gcf.train(method="grpo", model="tiny", dataset=rows, reward=my_reward, max_steps=10)

The names below load on first use, so `import gcfamily` stays cheap (no torch until needed).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "train": "gcfamily.api",
    "Method": "gcfamily.methods.base",
    "MethodSettings": "gcfamily.config",
    "Config": "gcfamily.config",
    "get_method": "gcfamily.methods",
    "load_rows": "gcfamily.data.sources",
    "Formatter": "gcfamily.data.encoding",
    "Batch": "gcfamily.core.batch",
    "GcfError": "gcfamily.errors",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gcfamily' has no attribute {name!r}")
