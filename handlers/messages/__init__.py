"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal now,
Slack later) only lay these texts out; they never word their own.
"""

from __future__ import annotations

# The sentences live in modules by who says them: core (every front end: the terminal,
# the CLI, the words Slack shares with them; with text, the shared words and escaping,
# destroys, listing and reports split from it), slack (Slack's own), lifecycle (quotas,
# the App Home, leases), builds (template builds), retire (template gc). Imported here,
# every one is `handlers.messages.NAME`.
from handlers.messages.builds import *  # noqa: F403
from handlers.messages.core import *  # noqa: F403
from handlers.messages.destroys import *  # noqa: F403
from handlers.messages.lifecycle import *  # noqa: F403
from handlers.messages.listing import *  # noqa: F403
from handlers.messages.reports import *  # noqa: F403
from handlers.messages.retire import *  # noqa: F403
from handlers.messages.slack import *  # noqa: F403
from handlers.messages.text import *  # noqa: F403
