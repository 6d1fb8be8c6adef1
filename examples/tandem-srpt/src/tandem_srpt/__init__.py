"""tandem-srpt: an example third-party policy plugin for tandem.

`srpt-order` (entry point in the `tandem.plugins` group), stacked with
`reference-scheduler`, admits WAITING requests shortest-remaining-processing-time first,
with aging so that no request starves. See `tandem_srpt.order` for the policy and its
starvation bound.
"""

from tandem_srpt.order import (
    SRPTOptions,
    SRPTOrder,
    overtaking_window,
    waiting_steps_bound,
)
from tandem_srpt.queue import SRPTQueue, remaining_work

__version__ = "0.1.0"

__all__ = [
    "SRPTOptions",
    "SRPTOrder",
    "SRPTQueue",
    "overtaking_window",
    "remaining_work",
    "waiting_steps_bound",
]
