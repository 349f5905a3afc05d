"""What a person asks for, until it is a recorded job: the `/deploy` grammar (`grammar`)
and the commands it parses to (`parsed`), validation into a `DeployRequest`
(`validation`), checks against the hypervisor (`admission`), quotas, and `intake`, which
records the job."""
