"""The life of a bucket (lightning_sdp4bit.schedule), with fake exchanges:
- gradient exchanges start strictly in bucket order, whatever order buckets become ready in;
- polling moves a two-stage exchange on only once its stage has completed, never waiting, and
  second stages go out in bucket order whichever first stage completes first;
- weight exchanges go out last bucket first; with a prefetch of k only k start at once, and a
  wait starts the due ones up to k past the bucket it waits for; without, all start at once;
- weight exchanges complete in launch order, and a wait moves the later ones on in that order;
- an exchange that has moved on is not asked again (polling after each launch stays linear);
- landed weights are reported once per bucket, and a new window needs the exchanges finished.
"""

import pytest

from lightning_sdp4bit.schedule import BucketSchedule, GradPhase, WeightPhase


class FakeExchange:
    def __init__(self, log, name):
        self.log, self.name, self.stage_done, self.asked = log, name, False, 0
        log.append(("start", name))

    def progress(self):
        self.asked += 1
        if self.stage_done and ("stage2", self.name) not in self.log:
            self.log.append(("stage2", self.name))
        return ("stage2", self.name) in self.log

    def wait(self):
        self.log.append(("wait", self.name))


def _schedule(count, prefetch=None):
    log, landed, exchanges = [], [], {}

    def start(kind):
        def launch(index):
            exchanges[(kind, index)] = FakeExchange(log, (kind, index))
            return exchanges[(kind, index)]

        return launch

    schedule = BucketSchedule(count, start("grad"), start("weight"), landed.append, weight_prefetch=prefetch)
    return schedule, log, landed, exchanges


def test_gradient_exchanges_start_in_order_and_poll_without_waiting():
    schedule, log, _, exchanges = _schedule(3)
    ready = {1}
    schedule.launch_ready(lambda i: i in ready)
    assert log == []  # bucket 1 is ready, but bucket 0 must go first
    ready |= {0}
    schedule.launch_ready(lambda i: i in ready)
    assert log == [("start", ("grad", 0)), ("start", ("grad", 1))]
    assert schedule.grad_phase == [GradPhase.EXCHANGING, GradPhase.EXCHANGING, GradPhase.ACCUMULATING]
    schedule.poll()
    assert ("stage2", ("grad", 0)) not in log  # not completed: polling does nothing
    exchanges[("grad", 0)].stage_done = True
    schedule.poll()
    assert ("stage2", ("grad", 0)) in log and not any(entry[0] == "wait" for entry in log)
    with pytest.raises(RuntimeError, match="in flight"):
        schedule.restart_grads()
    schedule.finish_grads()
    assert schedule.grads_reduced and ("start", ("grad", 2)) in log
    schedule.restart_grads()
    assert schedule.grad_phase == [GradPhase.ACCUMULATING] * 3


def test_second_stages_go_out_in_bucket_order_whichever_first_stage_completes_first():
    """A later bucket's first stage completing first (gloo's threads, a faster peer) must not
    reorder the second stages: on the other ranks they would be paired with another bucket's."""
    schedule, log, _, exchanges = _schedule(3)
    schedule.launch_ready(lambda i: i < 3)
    exchanges[("grad", 1)].stage_done = exchanges[("grad", 2)].stage_done = True
    schedule.poll()
    assert not any(entry[0] == "stage2" for entry in log)  # bucket 0 has not moved on yet
    exchanges[("grad", 0)].stage_done = True
    schedule.poll()
    assert [entry for entry in log if entry[0] == "stage2"] == [("stage2", ("grad", i)) for i in range(3)]


@pytest.mark.parametrize("prefetch", [None, 1, 2])
def test_weight_exchanges_go_out_last_bucket_first_and_prefetch(prefetch):
    schedule, log, landed, _ = _schedule(5, prefetch)
    schedule.start_weights()
    started = [name[1] for kind, name in log if kind == "start"]
    assert started == ([4, 3, 2, 1, 0] if prefetch is None else [4, 3, 2, 1, 0][:prefetch])
    assert schedule.weight_phase == [WeightPhase.EXCHANGING] * 5 and not schedule.weights_current
    schedule.wait_weights([3])  # the second module's forward
    started = [name[1] for kind, name in log if kind == "start"]
    assert started == [4, 3, 2, 1, 0][: 2 + (prefetch or 3)]
    assert landed == [4, 3] and schedule.weight_phase[3] is WeightPhase.CURRENT  # launch order
    schedule.wait_weights()
    assert sorted(landed) == [0, 1, 2, 3, 4] and schedule.weights_current
    assert [name[1] for kind, name in log if kind == "start"] == [4, 3, 2, 1, 0]


def test_weight_exchanges_complete_in_launch_order_and_later_ones_move_on_in_order():
    """A module that runs out of order (bucket 1 before 3) must not let this rank send a
    two-level all-gather's second stage before an earlier-launched one's: other ranks may
    send them in launch order, and same-size buckets would swap payloads."""
    schedule, log, landed, exchanges = _schedule(5)
    schedule.start_weights()  # launch order 4, 3, 2, 1, 0
    exchanges[("weight", 1)].stage_done = exchanges[("weight", 0)].stage_done = True
    schedule.wait_weights([3])
    assert landed == [4, 3]
    assert not any(entry[0] == "stage2" for entry in log)  # bucket 2 has not moved on: 1 and 0 wait
    exchanges[("weight", 2)].stage_done = True
    schedule.wait_weights([2])
    assert [entry for entry in log if entry[0] == "stage2"] == [("stage2", ("weight", i)) for i in (1, 0)]
    schedule.wait_weights([0])  # out of order: 1 completes first
    assert landed == [4, 3, 2, 1, 0] and schedule.weights_current


def test_an_exchange_that_has_moved_on_is_not_asked_again():
    schedule, _, _, exchanges = _schedule(4)
    schedule.launch_ready(lambda i: i < 2)
    exchanges[("grad", 0)].stage_done = True
    schedule.poll()  # 0 moves on; 1 is asked and has not completed
    asked = {i: exchanges[("grad", i)].asked for i in (0, 1)}
    schedule.launch_ready(lambda i: i < 4)  # two more launches, a poll after them
    schedule.poll()
    assert exchanges[("grad", 0)].asked == asked[0]  # not asked again
    assert exchanges[("grad", 1)].asked > asked[1] and exchanges[("grad", 2)].asked == 0  # 2 waits behind 1
    weights, _, _, sent = _schedule(3)
    weights.start_weights()  # launch order 2, 1, 0
    sent[("weight", 1)].stage_done = sent[("weight", 0)].stage_done = True
    weights.wait_weights([2])  # 2 lands; 1 and 0 move on
    before = [sent[("weight", i)].asked for i in (1, 0)]
    weights.wait_weights([2])
    assert [sent[("weight", i)].asked for i in (1, 0)] == before
