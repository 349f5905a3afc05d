"""The Slack front end: one concern per module.

- `app`: the Bolt app, the `/deploy` listener, answering people (`SlackBot`).
- `interact`: Approve / Reject and the other buttons; registers every listener.
- `modals`: the deploy form and the settings modal, opened, filled and submitted.
- `host`: `Host`, what of the bot `interact` and `modals` use (they never import `app`).
- `catalog`: what the backends offer the form for what it has chosen so far.
- `form`: the deploy form and the settings modal, laid out and read back.
- `threads`: the core's `Progress` as one channel message and thread per deploy
  (its shared state in `delivery`, template builds' notices in `buildthreads`).
- `outbox`: paced, coalescing delivery of those messages, per channel.
- `views`: Block Kit and the mrkdwn the bot adds (mentions).
- `serve`: `deploybot serve` (tokens, Socket Mode, HTTP mode).
- `manifest`: the Slack app manifest.

Imports point one way: `serve -> app -> interact -> modals -> host`,
`modals -> form -> catalog -> views` and `app -> threads -> buildthreads -> delivery ->
outbox`. This file imports nothing, so `deploybot manifest` (and anything else that
needs only `manifest`) does not load Bolt.
"""
