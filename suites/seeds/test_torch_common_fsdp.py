"""torch's own FSDP parity machinery (``torch.testing._internal.common_fsdp``) over the engine ``--engine``
selects, collected into the suites.

Written once, in ``harness.conformance.torch_common_fsdp``, so that ``python -m harness certify`` runs it
(its ``torch-common-fsdp`` family) from an installed package; importing the test class and its fixture
here makes pytest collect them with this suite (skipped, with the reason, where torch's testing extras do
not import or there is no GPU).
"""

from __future__ import annotations

from harness.conformance import torch_common_fsdp
from harness.conformance.torch_common_fsdp import TestTorchParityMachinery, _engine

__all__ = ["TestTorchParityMachinery", "_engine"]

pytestmark = torch_common_fsdp.pytestmark
