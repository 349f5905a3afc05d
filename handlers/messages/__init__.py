"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal, the CLI,
Slack) only lay these texts out; they never word their own.

The sentences live in modules by who says them, and a caller imports each from the
module that defines it (`from handlers.messages.core import finished`): core (every
front end: the terminal, the CLI, the words Slack shares with them), text (the shared
words and escaping), destroys, listing and reports (split from core), slack (Slack's
own), lifecycle (quotas, the App Home, VM leases), builds (template builds), retire
(template gc), migration (`migrate plan`), usage (the commands' grammar and help).
"""
