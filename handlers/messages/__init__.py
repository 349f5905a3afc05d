"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal now,
Slack later) only lay these texts out; they never word their own.
"""

from __future__ import annotations

# The sentences live in four modules, by who says them: core (every front end: the
# terminal, the CLI, the words Slack shares with them), slack (Slack's own), lifecycle
# (quotas, the App Home, leases), builds (template builds). Imported here, every one is
# `handlers.messages.NAME`.
from handlers.messages.builds import *  # noqa: F403
from handlers.messages.core import *  # noqa: F403
from handlers.messages.lifecycle import *  # noqa: F403
from handlers.messages.retire import *  # noqa: F403
from handlers.messages.slack import *  # noqa: F403
