"""Healing: what changes a run when a step goes wrong, in one place the loop calls by name.

    detect.py   the verdict on the monitor's reduced numbers: non-finite values, disagreeing HSDP
                replicas, spikes by the rules of rules.py (loss, gradient norm)
    replay.py   one more run of an anomalous step: a transient fault or a reproduced one
    suspicion.py  the suspicion tier: a gradient shard that rose alone replays the step, nothing else
    targets.py  the states a rollback may return to, the same whether or not the run restarted
    recover.py  restoring a target: from memory, from its checkpoint, or rebuilt by training forward
    healer.py   the state machine below, and its calls from the loop

States of the run and what moves it between them (one step at a time; every rank holds the same
numbers, so every rank takes the same transitions in the same step, with no extra agreement):

    HEALTHY   the step is applied; its values join the rules' windows (each rank's shard levels
              its own ring, monitor/shards.py); targets count it towards their confirmation;
              at cadence steps a new target is taken (held in memory when snapshots are on).
      -- a gradient shard rose alone (suspicion.py) -->  SUSPICIOUS
      -- a spike, a non-finite value or disagreeing replicas -->  SUSPECT
    SUSPICIOUS  the step is run once more from the same state and RNG (resilience.replay):
      -- some rank's statistics differ -->  HEALTHY, the replayed step applied: silent data
                           corruption; its host is counted as for a transient fault
      -- reproduced -->  HEALTHY, the step applied: the data's (the rules judge the replay)
    SUSPECT   the step is run once more from the same state and RNG (resilience.replay):
      -- clean replay -->  HEALTHY, the replayed step applied: a transient fault; its host is
                           counted (exit 6 after max_transient_per_rank on one host)
      -- reproduced (or replay off) -->  the action of monitor.nonfinite / monitor.on_spike:
           warn      HEALTHY, the step applied anyway (spikes only)
           skip      HEALTHY, the step not applied
           rollback  RESTORED (below)
           abort     ABORTED
      -- the max_consecutive-th anomalous step in a row, or one rollback too many --> ABORTED
    RESTORED  the newest good target before the anomaly (before the last one's target on a repeat
              within resilience.window) is loaded, targets after it dropped, the data from its
              cursor to the anomaly skipped, checkpoints after it retired, the restored state
              checkpointed at once; a target this process no longer holds is rebuilt:
      -- held, or read from its checkpoint -->  COOLDOWN
      -- rebuilt from an earlier state -->  FORWARD
    FORWARD   the steps from the loaded state to the target are trained again (counted once) -->
              COOLDOWN on reaching it (a `rebuilt` event)
    COOLDOWN  LR and clipping scaled down (resilience.lr_backoff, clip_backoff, compounding on
              repeats) until resilience.lr_cooldown_steps after the target, never past the run's
              end --> HEALTHY (an `lr_restore` event)
    ABORTED   the ABORTED marker and exit 3; checkpoints stay as they were.

With fault-tolerant replica groups (parallel/replicas/groups.py) the same machine runs in every group, in step:
the monitor's numbers are the whole job's (gradients averaged over the live groups before it
reads them, the loss averaged across groups), so every group takes every transition above in the
same step. Two more things can happen to a step:

    UNCOMMITTED  a reduction across groups failed (a group died inside the step) or torchft's
                 vote was no: nothing of the step is applied in any group (gradients dropped,
                 data cursor and RNG put back; a `commit_failed` event), and it runs again with
                 the next quorum, in the state it started from
    JOINED       a group behind the others (restarted, or it did not commit) takes a live peer's
                 whole state at the step's quorum: weights, optimizer, counters, the healer's
                 targets and windows, the back-off of a COOLDOWN, loss scale, RNG, data cursor;
                 it continues in the state the peer is in
A rollback is a committed step whose outcome is RESTORED: torchft's step count never goes back,
so a group joining afterwards receives the restored state.

An FP16 overflow under dynamic loss scaling is not an anomaly (the step is skipped, the scale
backs off); an overflow at the minimum scale is. Callbacks only observe what this decided
(StepResult.action, rolled_back, checkpoint_now and the events).
"""

from bigtrain.resilience.detect import Anomaly, Detector, Verdict
from bigtrain.resilience.healer import Healer, abort

__all__ = ["Anomaly", "Detector", "Healer", "Verdict", "abort"]
