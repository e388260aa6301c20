"""A stage whose backward posts, for its tensor peers, the collectives a rank that raised did not post
(tensor_parallel/collective_ledger.py's note; stage_failure.py's for the rest of a failure)."""
from __future__ import annotations

from ..tensor_parallel import collective_ledger as ledger
from .schedule import LoggedStage


class TensorPeerStage(LoggedStage):
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        """Records the tensor-parallel collectives of a backward that did not raise, per backward kind and
        input signature; on a rank with a kept error (LoggedStage caught it here, or the forward or the
        loss raised), posts those the backward did not: after the point where it raised, every one of a
        skipped backward's or of a forward the failure replaced with zeros."""
        ledgers = getattr(self.submod, "ledgers", None)
        if ledgers is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        key = ("backward", backward_type, self.submod.last_signature)
        with ledger.recording() as posted:
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        failure = self.submod.failure
        if failure is not None and failure.error is not None:
            ledger.post_rest(ledgers.get(key), len(posted))
        else:
            ledgers[key] = posted
        return result
