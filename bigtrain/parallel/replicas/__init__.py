"""Fault-tolerant replica groups on torchft: separate jobs that train one model together, may die
and rejoin while the others go on. groups.py: what the loop asks of them each step (the quorum,
cross-group means, the commit vote, a peer's state for a rejoining group, the end); connect.py:
how a group reaches torchft and its lighthouse; weights.py: every group's weights compared;
lighthouse.py: `bigtrain lighthouse`, which forms their quorums."""
