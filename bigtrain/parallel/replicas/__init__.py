"""Fault-tolerant replica groups on torchft: separate jobs that train one model together, may die
and rejoin while the others go on (groups.py: the quorum, cross-group means, commits, a peer's
state for a rejoining group, the weights compared at the end), and torchft's lighthouse that
forms their quorums (lighthouse.py)."""
