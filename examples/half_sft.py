"""A rule of one's own, and half of one: `gcf check examples/half_sft.py:HalfSFT` (docs/adding-a-method.md, section 5)."""

import torch

from gcfamily.methods.base import Batch
from gcfamily.methods.sft import SFT


class HalfSFT(SFT):
    """SFT at half weight: J = 1/2 * SFT's J, so GC = 1/2 on every completion token.

    Both functions change together, so `gcf check` holds the engine to this class's own objective.
    """

    name = "half-sft"
    gc_formula = "1/2"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().coefficient(batch, logps)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return 0.5 * super().objective(batch, logps, Z)


class HalfCoefficientSFT(SFT):
    """The coefficient halved and the objective left as SFT's: `gcf check` fails it, saying the objective must change too."""

    name = "half-coefficient-sft"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().coefficient(batch, logps)
