"""The names the vLLM connector uses for the cores and workers it drives.

Everything vLLM needs beyond the demo (a block table that grows with chunked prefill, an
abort, a non-blocking "are this layer's readers done", one agreement round per vLLM step)
lives in the cores and ``runtime/control.py`` themselves, so every protocol decision stays
where the model checker and the tables see it; these aliases only keep the connector's
vocabulary.
"""

from __future__ import annotations

from sfa_rd2h.runtime.control import AgreementLoop, DecodeWorker, PrefillWorker
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import PrefillCore

VllmPrefillCore = PrefillCore
VllmPrefillWorker = PrefillWorker
VllmDecodeCore = DecodeCore
VllmDecodeWorker = DecodeWorker
StepAgreement = AgreementLoop

__all__ = ["StepAgreement", "VllmDecodeCore", "VllmDecodeWorker", "VllmPrefillCore",
           "VllmPrefillWorker"]
