"""Running jobs of any kind: steps declared as data and the engine that runs them
(`steps`), the queue and its limits, how the core waits on backends, progress reports,
log fields, expected durations, cancelling, and finding a job from what a person typed
(`refs`)."""
