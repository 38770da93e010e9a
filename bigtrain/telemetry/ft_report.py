"""What replica groups (parallel/replicas/groups.py) did in a run, read from its events: the quorum's size over
time, and each failure with what it cost.

Each group's rank 0 writes its own `quorum` events (one per membership change it saw, with its
last commit before it: `last_commit_time`, and its median step: `median_step_s`), a
`quorum_commit` event at the first commit of each membership, and the `group_joined` of its own
joins; every line carries `group`. A failure is a quorum that lost a group. Its costs, all from
commit times (a group writes no event at every step, so its last event says nothing of when it
stopped training):

    commit_gap_s       the survivors' last commit before the failure to their first commit
                       after it (the step that failed, the wait for a quorum without the
                       group, and the step that ran again)
    survivors_stall_s  that gap less one normal step (their median step before it): the time
                       every survivor lost
    away_s             the survivors' last commit before the failure (the last step the lost
                       group took part in) to the lost group's first commit after its return
    join_s             a restarted group's own time from its process's start to taking part
                       (`group_joined` seconds: interpreter, bigtrain start-up, quorum,
                       transfer); absent for a live group that was late and caught up
    transfer_s, bytes  the state it received from a live peer
    reason             `dead` or `late`, from the leading group's `group_left` event
"""

from __future__ import annotations

from typing import Any


def quorums(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct quorum once (the first group to log it), in time order."""
    seen: dict[Any, dict[str, Any]] = {}
    for e in sorted((e for e in events if e["kind"] == "quorum"), key=lambda e: e["time"]):
        seen.setdefault(e.get("quorum_id", (e["step"], tuple(e["participants"]))), e)
    return list(seen.values())


def quorum_series(events: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(step, groups taking part) at each membership change."""
    rows = quorums(events)
    return [e["step"] for e in rows], [e["groups"] for e in rows]


def failures(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every quorum that lost a group, with its costs (module docstring)."""
    out, previous = [], None
    for q in quorums(events):
        current = set(q["participants"])
        for group in sorted(set(previous or ()) - current):
            out.append(_failure(events, q, group))
        previous = current
    return out


def _failure(events: list[dict[str, Any]], q: dict[str, Any], group: int) -> dict[str, Any]:
    """One lost group's row: the quorum `q` that left it out, read against commit times."""
    seen = [e for e in events if e["kind"] == "quorum" and e.get("quorum_id") == q.get("quorum_id")]
    last = max((e["last_commit_time"] for e in seen if e.get("last_commit_time")), default=None)
    step_s = max((e["median_step_s"] for e in seen if e.get("median_step_s")), default=0.0)
    after = min(
        (
            e["time"]
            for e in events
            if e["kind"] == "quorum_commit" and e.get("quorum_id") == q.get("quorum_id")
        ),
        default=None,
    )
    later = [e for e in events if e.get("group") == group and e["time"] > q["time"]]
    back = next((e for e in later if e["kind"] == "quorum_commit"), None)
    join = next((e for e in later if e["kind"] == "group_joined"), None)
    left = next(
        (
            e
            for e in events
            if e["kind"] == "group_left"
            and e["group"] == group
            and e.get("reported_by") != group
            and abs(e["step"] - q["step"]) <= 1
        ),
        None,
    )
    row: dict[str, Any] = {"step": q["step"], "group": group}
    if left is not None:
        row["reason"] = left["reason"]
    if last is not None and after is not None:
        row["commit_gap_s"] = round(after - last, 3)
        row["survivors_stall_s"] = round(max(after - last - step_s, 0.0), 3)
    if last is not None and back is not None:
        row["away_s"] = round(back["time"] - last, 3)
    if join is not None:
        row.update(joined_step=join["step"], transfer_s=join["transfer_s"], bytes=join["bytes"])
        if "seconds" in join:
            row["join_s"] = join["seconds"]
    return row


def failures_html(rows: list[dict[str, Any]]) -> str:
    """The report's table of failures (nothing for a run without replica groups)."""
    if not rows:
        return ""
    keys = [
        "step",
        "group",
        "reason",
        "survivors_stall_s",
        "commit_gap_s",
        "away_s",
        "joined_step",
        "join_s",
        "transfer_s",
    ]
    head = "".join(f"<th>{k}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{r.get(k, '')}</td>" for k in keys) + "</tr>" for r in rows
    )
    return f"<h2>replica group failures</h2><table><tr>{head}</tr>{body}</table>"
