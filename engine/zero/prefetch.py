"""ZeRO stage 3 parameter coordinator: gather before use, release after, prefetch by recorded order.

[Note: passes and the trace] A *pass* runs from the root's forward pre-hook to the end of backward
(or to the end of a forward without gradients). The first training pass records its events — (pre or
post, forward or backward, unit) — as the *trace*. From the trace a dry run of the release policy
derives the *plan*: the all-gathers of one pass in order, and after each post event which groups to
keep (`max_reuse_distance`: the group is used again within that many parameter elements, and at most
`max_live_parameters` elements stay gathered: release_plan.py, note: live limit). Later training passes issue the
plan's all-gathers ahead of use, up to `prefetch_bucket_size` elements in flight, asynchronously on
their own process group, so they overlap compute and never queue behind gradient reduce-scatters.
[Note: same collectives on every rank] Plan gathers are issued in plan order whatever this rank runs:
a unit skipped on this rank (a branch not taken) only leaves an unused gather, released at pass end,
so ranks never disagree on the sequence. Passes without a plan — evaluation, and the training pass
that records the trace — gather in *request rounds* (gather_requests.py): every rank says which group
it needs next and all gather every group asked for, so each rank runs its own path (an MoE expert
only some ranks' tokens reach) and computes what it would alone. A recorded trace is kept only if
every round was unanimous and every rank derived the same plan (one tiny all-gather per recording);
else the next pass records again, so a model whose ranks keep diverging gathers in rounds throughout.
A unit a plan pass does not expect ends prefetching on that rank. In forward, all ranks then switch
to request rounds (note: leaving the plan, one tiny all-reduce at the end of each plan pass's
forward). Backward runs the units forward ran, on every rank (anchors.py), so it leaves the plan
only where forward did. Should it still (a backward order that autograd schedules differently on
some rank), the rank gathers *on demand*, each gather preceded by a fixed-size all-gather of group ids
compared at the end of the pass (note: no host reads per unit); the others are still on the plan, so
the collectives differ (an error naming the modules when sizes agree; gloo aborts on a size mismatch:
docs/zero3.md, limits). At the end of each training pass the ranks agree (one tiny all-reduce)
whether to re-record the trace.
[Note: the whole plan on every rank] Each rank issues every plan gather every training pass, also
those of units it does not reach at the end of the plan (an MoE expert none of its tokens chose): the
forward's remaining ones when its forward ends, the rest before the gradients are reduced (a rank
waiting on a reduce-scatter must not owe the others a gather) and at the end of the pass. Without that
the other ranks wait forever on gathers it never issues. Request rounds end at the same two points.
[Note: reductions wait] A gradient bucket is reduced once all its parameters have their gradient on
this rank. A rank that skipped a unit lacks that unit's gradients until its backward ends, while the
others reduce the bucket mid-backward and wait on it there, issuing no further plan gathers and
answering no request rounds, which the first rank needs to finish its backward: a hang. So in a pass
in which the ranks' forwards differed (a round that was not unanimous, forward's rounds ending
included, or a rank that skipped events of the plan: the end-of-forward all-reduce carries that too),
every rank holds its gradients and launches the buckets when its backward ends, owing no gather then:
such a pass gives up the overlap and holds the whole gradient; passes whose ranks agree keep both. A
unit skipped in backward only (one whose output gets no gradient on some rank) cannot happen in a
training pass (anchors.py); a backward outside its pass waits for its end (note there).
The same holds *inside* a unit: a head the root owns, or a branch inside a block, called on some ranks
only, leaves every unit event alike, but its parameters get a gradient there only (fuzzer seeds 106,
171, 173: the flagged rank waited on the head's bucket, in flight or without overlap, while another
was in the round that closes the recording pass's backward or waited on a plan gather the first no
longer issued). So at the end of each training forward every rank also digests which trainable
parameters its unit outputs (the root's included: noted before its end of forward) lead to, walking
the autograd graph once (arrivals.reach_fingerprint; ~0.4 ms for a 6-layer GPT's 273 nodes, loaded
CPU), and the ranks compare it: in the plan pass's all-reduce, and in one tiny all-reduce of its own
after a forward in request rounds that was unanimous. Different digests defer the pass's reductions.
Not seen: a parameter that only a tensor outside the unit outputs leads to (an auxiliary loss kept on a
module and added by the user), and what an unrecorded reentrant region uses inside (one opaque region).
[Note: one copy per group] Prefetch stops at a plan gather of a group that is gathered or in flight:
issuing it then would hand the later gather to the earlier use (`max_reuse_distance` 0 and a large
bucket: a unit's backward gather consumed by its forward), and backward would find the plan exhausted.
Every data all-gather also carries the group id (stage3_params.py, note: tags), and a wait that times
out names the module it was waiting for.
[Note: no host reads per unit] Reading tags or ids back to the host on every gather would stall a GPU
run's CPU run-ahead, which is what prefetching lives on. So plan passes compare tags and ids on the
device and read the result once at the pass's end, together with the re-record flag (one host read
per training pass, none at world size 1); a mismatch found there raises before the optimizer step
can apply mixed weights. Request rounds (evaluation, recording) and gathers outside passes
(GatheredParameters, saving) read the ids at every gather: agreeing is what they are for.
"""
from __future__ import annotations

from collections import Counter

import torch

from offload.aio import OffloadIOError
from offload.host_heap import forward_in_heap, tier_buffers

from .anchors import BackwardAnchors
from .arrivals import reach_fingerprint
from .release_plan import ReleasePlanner
from .gather_requests import RankDivergenceError, RequestRounds
from .group_agreement import GroupAgreement
from .stage3_params import GatherGroup
from .stage3_read_failures import ReadFailures


class ParamCoordinator(GroupAgreement):
    def __init__(self, units: list, hooks: list, groups: list[GatherGroup], comm, *, prefetch_numel: int,
                 max_live_numel: int, max_reuse_distance: int, agree_comm=None):
        self.units, self.groups, self.comm = units, groups, comm
        self.agree_comm = agree_comm or comm  # the end-of-forward agreement: not on `comm` (note: leaving the plan)
        self.group_of = {p: g for g in groups for p in g.params}
        self.unit_groups = [u.groups for u in units] + [gs for _, _, gs in hooks]
        self.unit_names = [u.name for u in units] + [name for name, _, _ in hooks]
        self.prefetch_numel, self.max_live = prefetch_numel, max_live_numel
        self.max_reuse = max_reuse_distance
        self.pending: dict[int, tuple] = {}  # gid -> (work, out) of an issued all-gather
        self.active: Counter = Counter()
        # gid -> open GatheredParameters blocks holding it: no pass releases it meanwhile (a forward
        # inside the block, e.g. generating with the weights gathered, used to leave them placeholders)
        self.user_held: Counter = Counter()
        self.in_pass = self.training_pass = self.in_backward = False
        self.requests = RequestRounds(self)  # gather_requests.py's note
        self.by_request = False  # this pass gathers in request rounds: every rank gathers on demand in it
        self.held = False  # a pipeline step holds every group gathered (engine/pipe/zero3.py)
        self.trace: list | None = None
        self.recording: list | None = None
        self.plan: list[tuple[int, int]] = []
        self.keep: dict[int, set] = {}
        self.cursor = self.plan_ptr = 0
        self.diverged = False
        self.skipped = False  # this plan pass skipped events of the trace (a unit not reached here)
        self.defer_reductions = False  # note: reductions wait
        self.gather_log: list[tuple[str, str]] = []  # (phase, group name) per all-gather, for tests
        self.checks: list[tuple[GatherGroup, torch.Tensor]] = []  # this pass's ids on the device (module note)
        self.read_ahead_groups = 0  # NVMe parameters: plan groups whose slots are read ahead (param_nvme.py)
        self.anchors = BackwardAnchors()  # this training pass's unit outputs (anchors.py)
        self.reach_index: dict = {}  # trainable parameter -> position, for the ranks' reach (note: reductions wait)
        self.failures = ReadFailures(comm.rank, comm.world_size, groups)  # stage3_read_failures.py
        self.before_pass = None  # called before each pass (stage3.py: a failed persistent refresh is retried)

    # -- pass boundaries ---------------------------------------------------------------------------
    def _begin_pass(self) -> None:
        if self.in_pass:
            self.end_pass()
        self.in_pass, self.in_backward = True, False
        self.training_pass = torch.is_grad_enabled() and self.units[0].module.training
        self.cursor = self.plan_ptr = 0
        self.diverged = self.skipped = False
        self.gather_log = []
        self.failures.clear()
        if self.training_pass and self.trace is None:
            self.recording = []
        self.by_request = not self.training_pass or self.recording is not None  # evaluation, or recording
        self.forward_agreed = self.by_request  # a plan pass agrees once, at the end of its forward
        self.defer_reductions = False  # note: reductions wait
        self.requests.mixed = False
        self.anchors.clear()
        if self.training_pass:
            self.anchors.open()  # reentrant regions' outputs too (anchors.py's note)

    def end_pass(self) -> None:
        """Drain every issued gather, release everything not persistent, settle the trace. Also after a
        backward that ran outside a pass (an evaluation forward came in between): nothing stays gathered."""
        self.before_reduction()
        self._let_go()
        settle, complete = self.in_pass and self.training_pass, self.in_backward
        self.in_pass = self.training_pass = self.in_backward = False
        checks, self.checks = self.checks, []
        if settle:
            self._settle_trace(checks, complete)
        elif checks:
            self._raise_on_mismatch(checks, self._mismatches(checks).any().item())
        if self.failures.known:  # a read failed on some rank (stage3_read_failures.py's note)
            raise self.failures.error(in_backward=complete)

    def _let_go(self) -> None:
        """Drain every issued gather, release everything not persistent or held by a block."""
        for gid in list(self.pending):
            self._finish(self.groups[gid], unpack=False)
        for g in self.groups:
            if g.gathered and not self.user_held[g.gid]:
                g.release()
        self.active.clear()
        self.defer_reductions = False
        self.anchors.close()
        self.anchors.clear()

    def _fail_pass(self) -> None:
        """Every rank knows of a failed read at this point of a forward: each ends the pass here, owing no
        gather (every rank issued the same plan gathers), and raises (stage3_read_failures.py's note)."""
        self._let_go()
        self.in_pass = self.training_pass = self.in_backward = self.by_request = False
        self.checks, self.recording = [], None  # a recording pass records again
        raise self.failures.error(in_backward=False)

    def _settle_trace(self, checks: list, complete: bool) -> None:
        """One host read per training pass: re-record the trace? did any gather bring another group?
        A recording that ended before its backward (an evaluation forward came in between: note, a
        backward outside its pass) is dropped on every rank: a plan without backward would send a later
        pass's backward off it, gathering on demand where the ranks may differ."""
        if self.recording is not None:
            trace, self.recording = self.recording, None
            if not complete:
                return
            plan, keep = ReleasePlanner(self.unit_groups, self.groups, self.max_live, self.max_reuse).simulate(trace)
            if not self.requests.mixed and self._same_plan_everywhere(plan):  # else record the next pass
                self.trace, self.plan, self.keep = trace, plan, keep
            return
        if self.comm.world_size == 1:  # a world of one cannot diverge from itself
            rerecord = self.diverged
        else:
            flag = self.comm.zeros(2)
            if self.diverged:
                flag[0].fill_(1.0)
            if checks:
                flag[1].copy_(self._mismatches(checks).sum())
            self.comm.all_reduce(flag)  # every rank re-records, or none does
            rerecord, mismatched = flag.tolist()
            self._raise_on_mismatch(checks, mismatched)
        if rerecord > 0:
            self.trace, self.plan, self.keep = None, [], {}

    # -- hook entry points (stage3_units.install_hooks) -------------------------------------------
    def pre_forward(self, unit: int) -> None:
        if unit == 0:  # the model's forward runs in glibc's heap, where the NVMe parameter tier bounds it
            forward_in_heap(True)
        if self.held:
            return
        if unit == 0 and self.before_pass is not None:
            self.before_pass()
        if unit == 0:  # the root: a new pass (a previous one without backward ends here)
            self._begin_pass()
        self._pre(unit, "F")

    def post_forward(self, unit: int) -> None:
        if unit == 0:
            forward_in_heap(False)
        if self.held:
            return
        self._post(unit, "F")
        if unit == 0 and not torch.is_grad_enabled():
            self.end_pass()
        elif unit == 0:
            self.anchors.close()
            self.issue_rest_of_plan("F")
            self._agree_after_forward()
            if self.by_request:  # rounds end with the forward too: between it and backward the user may
                self.requests.close()  # run collectives of their own (a logged loss's all-reduce)
                self.defer_reductions |= self.requests.mixed  # the ranks' paths differed (every rank knows)
            if self.failures.known:  # every rank read the failed tag, or a world of one
                self._fail_pass()
            if self.by_request and self.training_pass and not self.defer_reductions and self.comm.world_size > 1:
                self.defer_reductions = self._reach_differs()  # all agree

    def _agree_after_forward(self) -> None:
        """[Note: leaving the plan] A rank whose forward meets a unit the plan does not have at that point
        (an expert no rank's tokens reached while the order was recorded) cannot gather it alone: the
        others issue plan gathers without asking. So a plan pass's forward ends with one tiny all-reduce,
        on the reduction group (the gather group's order differs between ranks here; no reduction runs in
        forward), of (left the plan?, plan gathers issued). The rank that left joins it at once. If any rank
        left, each issues the plan gathers up to the most any rank issued (unused), and the rest of the
        pass, backward included, gathers in request rounds. A rank that leaves the plan in backward is not
        covered (docs/zero3.md, limits): reductions are under way there."""
        if self.forward_agreed or self.comm.world_size == 1:
            return
        self.forward_agreed = True
        self._issue_plan_through_phase("F")  # the others' forwards need every forward gather
        (left, issued, skipped, failed), reach_differs = self._max_with_reach(
            [float(self.diverged), float(self.plan_ptr), float(self.skipped), self.failures.flag()])
        self.defer_reductions = bool(left or skipped or reach_differs)  # note: reductions wait
        if left or failed:
            while self.plan_ptr < int(issued):
                self._issue_plan_entry()
        if failed:  # a read failed on some rank in this forward (stage3_read_failures.py's note)
            self.failures.note_flag(failed)
            self._fail_pass()
        if left:
            self.diverged = self.by_request = True

    def _reach(self) -> float:
        """This rank's digest of the trainable parameters that this training pass's unit outputs (the root's
        included) lead to: those whose gradients its backward will bring (arrivals.reach_fingerprint)."""
        return float(reach_fingerprint([edge.node for edge, *_ in self.anchors.edges], self.reach_index))

    def _reach_differs(self) -> bool:
        """Do the ranks' forwards give gradients to different parameters (note: reductions wait)? One tiny
        all-reduce, at the end of a training forward that gathered in request rounds."""
        return self._max_with_reach([])[1]

    def _max_with_reach(self, values: list[float]) -> tuple[list[float], bool]:
        """One MAX all-reduce of `values` and of this rank's reach digest and its negation: (the values'
        maxima over the ranks, whether the ranks' digests differ: max != -max(-digest)). float64: the
        52-bit digest is exact."""
        reach = self._reach()
        flag = self.agree_comm.tensor([*values, reach, -reach], dtype=torch.float64)
        self.agree_comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        *maxima, most, least = flag.tolist()
        return maxima, most != -least

    def before_reduction(self) -> None:
        """Once this rank's backward is done, before it waits on gradient reductions (or the pass ends):
        it must owe the other ranks no gather, or they would wait on each other."""
        self.issue_rest_of_plan()
        if self.by_request:
            self.by_request = False
            self.requests.close()

    def issue_rest_of_plan(self, phase: str | None = None) -> None:
        """Issue the plan gathers this rank has not issued (of `phase` only, if given): module note,
        the whole plan on every rank. Not while off the plan: this rank gathers on demand then."""
        if not (self.in_pass and self.training_pass and self.trace is not None and self.recording is None):
            return
        if not self.diverged:
            self._issue_plan_through_phase(phase)

    def _issue_plan_through_phase(self, phase: str | None) -> None:
        while self.plan_ptr < len(self.plan):
            if phase is not None and self.trace[self.plan[self.plan_ptr][0]][1] != phase:
                return
            self._issue_plan_entry()

    def note_outputs(self, tensors: list) -> None:
        """A unit's outputs: anchored in training passes (anchors.py's note)."""
        if not self.held and self.in_pass and self.training_pass:
            self.anchors.note(tensors)

    def backward_anchors(self) -> list:
        """(gradient edge, zero gradient) for each unit output of this training pass (anchors.py)."""
        anchors = self.anchors.take()
        return anchors if self.in_pass and self.training_pass else []

    def pre_backward(self, unit: int) -> None:
        if self.held:
            return
        if not self.in_backward and not (self.in_pass and self.training_pass):
            self._begin_backward_outside_pass()
        self.in_backward = True
        self._pre(unit, "B")

    def _begin_backward_outside_pass(self) -> None:
        """[Note: a backward outside its pass] An evaluation forward between a training forward and its
        backward (a validation loss, a generation) began a pass of its own, which ended the training
        pass: its backward then runs outside any training pass, against no plan. Each of its gathers is
        a request round (gather_requests.py) and its gradient reductions wait for its end (note:
        reductions wait), as in a pass whose ranks diverged: this backward may run different units on
        different ranks (an MoE's experts), and nothing was agreed about it. Every rank ran the same
        evaluation forward, so every rank's backward begins here. Before, its gathers were on demand,
        each checked at once: the first expert one rank ran and another did not raised
        RankDivergenceError."""
        self.by_request = self.defer_reductions = True
        self.requests.mixed = False

    def post_backward(self, unit: int) -> None:
        if self.held:
            return
        self._post(unit, "B")

    # -- events ----------------------------------------------------------------------------------
    def _observe(self, event: tuple) -> int | None:
        """Index of `event` in the trace, or None (recording, evaluation, or off the trace)."""
        if not self.in_pass or not self.training_pass:
            return None
        if self.recording is not None:
            self.recording.append(event)
            return None
        if self.trace is None or self.diverged:
            return None
        for i in range(self.cursor, len(self.trace)):  # skipping ahead is fine (module note)
            if self.trace[i] == event:
                self.skipped |= i > self.cursor
                self.cursor = i + 1
                return i
        self.diverged = True
        return None

    def _pre(self, unit: int, phase: str) -> None:
        i = self._observe(("pre", phase, unit))
        for g in self.unit_groups[unit]:
            self.active[g.gid] += 1
            self._need(g, i)
        if i is not None:
            self._prefetch()

    def _post(self, unit: int, phase: str) -> None:
        i = self._observe(("post", phase, unit))
        keep = self.keep.get(i, ()) if i is not None else ()
        for g in self.unit_groups[unit]:
            self.active[g.gid] = max(0, self.active[g.gid] - 1)
            if self.active[g.gid] == 0 and g.gathered and g.gid not in keep and not self.user_held[g.gid]:
                g.release()

    # -- gathering -------------------------------------------------------------------------------
    def _need(self, g: GatherGroup, i: int | None) -> None:
        if g.gid not in self.pending and not g.gathered:
            if i is None and self.diverged and not self.in_backward:
                self._agree_after_forward()  # this rank left the plan in forward (note: leaving the plan)
            if self.by_request:
                self.requests.gather(g)
            elif i is None or not self._issue_through(g):
                self._check_same_group(g)
                self._issue(g)
        if g.gid in self.pending:
            self._finish(g)

    def _issue_through(self, g: GatherGroup) -> bool:
        """Issue plan gathers in order up to the next one of `g`; False when the plan has none left."""
        for k in range(self.plan_ptr, len(self.plan)):
            if self.plan[k][1] == g.gid:
                while self.plan_ptr <= k:
                    self._issue_plan_entry()
                return True
        self.diverged = True
        return False

    def _prefetch(self) -> None:
        ahead = sum(self.groups[gid].numel for gid in self.pending)
        live = ahead + sum(g.numel for g in self.groups if g.gathered)
        while self.plan_ptr < len(self.plan):
            g = self.groups[self.plan[self.plan_ptr][1]]
            if ahead + g.numel > self.prefetch_numel or live + g.numel > self.max_live:
                return
            if g.gid in self.pending or g.gathered:
                return  # its next gather waits for the release of this one (module note: one copy per group)
            self._issue_plan_entry()
            ahead += g.numel
            live += g.numel

    def _issue_plan_entry(self) -> GatherGroup:
        event, gid = self.plan[self.plan_ptr]
        self.plan_ptr += 1
        self._issue(self.groups[gid], phase=self.trace[event][1])
        return self.groups[gid]

    def _issue(self, g: GatherGroup, phase: str | None = None) -> None:
        if g.gid in self.pending:  # the plan gathers it again before its last gather was used
            self._finish(g, unpack=False)
        with tier_buffers():  # not in the forward's heap (offload/host_heap.py's fourth note)
            out = g.output_buffer()
            # a failed read is sent marked, not raised (stage3_read_failures.py's note)
            work = self.comm.all_gather(out, g.send_buffer(self.failures.note_mine), async_op=True)
            self.pending[g.gid] = (work, out)
            try:
                for _, gid in self.plan[self.plan_ptr:self.plan_ptr + self.read_ahead_groups]:
                    self.groups[gid].sources.read_ahead()  # from swap files, while this gather runs
            except OffloadIOError:
                pass  # a read ahead that did not start: the gather reads again, and says if that fails
        self.gather_log.append((phase or ("B" if self.in_backward else "F"), g.name))

    def _finish(self, g: GatherGroup, unpack: bool = True) -> None:
        work, out = self.pending.pop(g.gid)
        try:
            if work is not None:
                work.wait()
        except RuntimeError as e:
            raise RankDivergenceError(
                f"ZeRO-3: rank {self.comm.rank} timed out gathering the parameters of module '{g.name}' "
                f"({e}). Another rank did not run the same module at this point: rank-divergent control "
                "flow (a layer skipped or added on some ranks, a different number of forward passes) is "
                "not allowed with zero_optimization.stage 3") from e
        if self.comm.world_size == 1:
            pass  # a world of one gathers only its own tags
        elif self._deferred_checks():
            self.checks.append((g, g.tag_ids(out)))
        else:
            tags = g.tags_of(out)
            if not self.failures.note_ids(tags) and any(t != g.gid for t in tags):
                raise self._divergence(g, tags)
        if self.failures.known and not (self.in_pass or self.in_backward):  # outside passes: every rank here
            raise self.failures.error(in_backward=False, in_pass=False)
        if unpack and not (g.gathered and self.user_held[g.gid]):  # a GatheredParameters block's values are
            with tier_buffers():  # the user's (an edit with modifier_rank): a plan gather of the group must
                g.unpack(out)  # not undo them

    # -- outside passes ----------------------------------------------------------------------------
    def gather_now(self, groups: list[GatherGroup], check: bool = True) -> list[GatherGroup]:
        """Gather `groups` on demand (GatheredParameters, saving); returns those this call gathered.
        `check=False` skips the id all-gather before each (the data all-gather's tags are still checked)."""
        got = []
        for g in groups:
            if not g.gathered and g.gid not in self.pending:
                if check:
                    self._check_same_group(g)
                self._issue(g)
                got.append(g)
            if g.gid in self.pending:
                self._finish(g)
        return got

    def hold_all(self, check: bool = True) -> None:
        """Gather every group now and keep it through any number of passes, the hooks doing nothing,
        until `release_all` (a pipeline schedule's micro-batches: engine/pipe/zero3.py's note)."""
        self.gather_now(self.groups, check=check)
        self.held = True

    def release_all(self) -> None:
        """After an optimizer step: drop every gathered copy (its values are stale)."""
        self.held = False
        self.end_pass()
        for g in self.groups:
            if g.gathered:
                g.release()
