"""What replica groups (parallel/ft.py) did in a run, read from its events: the quorum's size over
time, and each failure with what it cost.

Each group's rank 0 writes its own `quorum` events (one per membership change it saw) and the
`group_joined` of its own joins; every line carries `group`. A failure is a quorum that lost a
group. Its costs:

    survivors_stall_s  from the lost group's last event before the failure (the step it died in
                       had started by then) to the first quorum without it: what every survivor
                       waited (the lighthouse's heartbeat timeout, or a failed reduction's retry)
    away_s             from that last event to the group's next join: its capacity was missing
    join_s             the joined process's own time from its start to taking part
                       (`group_joined` seconds: interpreter, bigtrain start-up, quorum, transfer)
    transfer_s, bytes  the state it received from a live peer
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
            last = max(
                (e["time"] for e in events if e.get("group") == group and e["time"] < q["time"]),
                default=None,
            )
            join = next(
                (
                    e
                    for e in events
                    if e["kind"] == "group_joined" and e["group"] == group and e["time"] > q["time"]
                ),
                None,
            )
            row: dict[str, Any] = {"step": q["step"], "group": group}
            if last is not None:
                row["survivors_stall_s"] = round(q["time"] - last, 3)
                if join is not None:
                    row["away_s"] = round(join["time"] - last, 3)
            if join is not None:
                row.update(
                    joined_step=join["step"],
                    join_s=join["seconds"],
                    transfer_s=join["transfer_s"],
                    bytes=join["bytes"],
                )
            out.append(row)
        previous = current
    return out


def failures_html(rows: list[dict[str, Any]]) -> str:
    """The report's table of failures (nothing for a run without replica groups)."""
    if not rows:
        return ""
    keys = ["step", "group", "survivors_stall_s", "away_s", "joined_step", "join_s", "transfer_s"]
    head = "".join(f"<th>{k}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{r.get(k, '')}</td>" for k in keys) + "</tr>" for r in rows
    )
    return f"<h2>replica group failures</h2><table><tr>{head}</tr>{body}</table>"
