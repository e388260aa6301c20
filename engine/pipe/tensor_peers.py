"""A stage whose backward and loss post, for its tensor peers, the collectives a rank that raised did not
post, and run guarded while there is no record to post from (tensor_parallel/collective_ledger.py's note;
stage_failure.py's for the rest of a failure)."""
from __future__ import annotations

from ..tensor_parallel import collective_ledger as ledger
from .schedule import LoggedStage
from .stage_failure import skipped_backward, substitute_loss


class TensorPeerStage(LoggedStage):
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        """Records the tensor-parallel collectives of a backward that did not raise, per backward kind and
        input signature; on a rank that knows the batch failed (LoggedStage caught an error here, the
        forward or the loss raised, a tensor peer raised in a guarded run), posts those the backward did
        not: after the point where it raised, every one of a skipped backward's or of a forward the failure
        replaced with zeros. Without a record yet, the backward runs guarded (`_first_backward`)."""
        chunk = self.submod
        ledgers = getattr(chunk, "ledgers", None)
        if ledgers is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        key = ("backward", backward_type, chunk.last_signature)
        recorded = ledgers.get(key)
        if recorded is None and chunk.model_comm is not None:
            return self._first_backward(key, backward_type, bwd_kwargs, last_backward)
        with ledger.recording() as posted:
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if chunk.failure.known:  # nothing when this backward ran whole (it posted all of the record)
            ledger.post_rest(recorded, len(posted))
        else:
            ledgers[key] = posted
        return result

    def _first_backward(self, key, backward_type, bwd_kwargs, last_backward):
        """A backward with no record of its (kind, signature): each tensor-parallel collective is preceded by
        a round over the model group, and one more ends it (the ledger's note). Every tensor rank of the
        stage has a record of the same keys (made here on all of them or none), so all of them come here
        together. A rank that knows the batch failed has nothing to post from: it posts a 1 and skips this
        and the batch's later backward passes; so does a rank whose backward raised, at the point where it
        raised; a peer meets the 1 at its next round and raises TensorPeerFailed, which LoggedStage keeps
        (it skips the rest likewise). Then every tensor rank of the stage knows, and no record is made."""
        failure, comm = self.submod.failure, self.submod.model_comm
        if failure.known:
            ledger.agree(comm, True)
            failure.in_backward = True  # the batch's later backward passes: skipped (stage_failure.py)
            return skipped_backward(bwd_kwargs)
        with ledger.recording() as posted, ledger.guarding(comm):
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if failure.error is not None:  # this rank's own, kept by LoggedStage: told in the round it did not reach
            ledger.agree(comm, True)
        elif not failure.peer_failed:  # else a round already told it, inside the backward
            try:
                ledger.agree(comm, False)  # the backward's end
                self.submod.ledgers[key] = posted
            except ledger.TensorPeerFailed as err:  # a peer raised after its last collective
                failure.keep_backward(err)
        return result


def ledgered_loss(chunk, failure, flat_output, loss_fn):
    """`loss_fn()` on the last stage, recorded per signature of the outputs it reads, since it may post
    tensor-parallel collectives of its own (a vocab-parallel cross-entropy): on an error, kept in `failure`,
    a zero loss in its place and the rest of the record posted for the tensor peers; guarded while there is
    no record, as a first backward is (TensorPeerStage)."""
    key = ("loss", ledger.signature(flat_output))
    recorded = chunk.ledgers.get(key)
    guard = chunk.model_comm if recorded is None else None
    if guard is not None and failure.known:  # nothing to post from: the peers meet this 1 at their next round
        ledger.agree(guard, True)
        return substitute_loss(flat_output)
    with ledger.recording() as posted:
        try:
            with ledger.guarded(guard):
                loss = loss_fn()
        except Exception as err:  # noqa: BLE001 - kept and raised after the schedule (stage_failure.py)
            failure.keep(err)
            ledger.post_rest(recorded, len(posted))
            return substitute_loss(flat_output)
    if not failure.known:
        chunk.ledgers[key] = posted
    return loss
