"""The deploy kind: a VM from a template. What it declares to the engine (`kind`: approval,
recovery, cancel), its steps as data and their undo (`pipeline`), a run's plain data
(`runs`), and its destroy phase: destroying a VM deploybot built (`destroy`) and which
jobs may be destroyed (`destroyable`)."""
