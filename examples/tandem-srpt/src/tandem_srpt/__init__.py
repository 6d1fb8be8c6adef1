"""tandem-srpt: an example third-party scheduler plugin for tandem.

`srpt-scheduler` (entry point in the `tandem.plugins` group) admits WAITING requests
shortest-remaining-processing-time first, with aging so that no request starves. See
`tandem_srpt.scheduler` for the policy and its starvation bound.
"""

from tandem_srpt.queue import SRPTQueue, remaining_work
from tandem_srpt.scheduler import (
    SRPTOptions,
    SRPTScheduler,
    overtaking_window,
    waiting_steps_bound,
)

__version__ = "0.1.0"

__all__ = [
    "SRPTOptions",
    "SRPTQueue",
    "SRPTScheduler",
    "overtaking_window",
    "remaining_work",
    "waiting_steps_bound",
]
