"""tandem-lrw: an example third-party policy plugin for tandem.

`lrw-victim` (entry point in the `tandem.plugins` group), stacked with
`reference-scheduler`, preempts the running request with the longest remaining work, and
never one already preempted `max_preemptions` times while another candidate exists. See
`tandem_lrw.victim` for the policy and its starvation bound.
"""

from tandem_lrw.victim import LRWOptions, LRWVictim, remaining_work

__version__ = "0.1.0"

__all__ = ["LRWOptions", "LRWVictim", "remaining_work"]
