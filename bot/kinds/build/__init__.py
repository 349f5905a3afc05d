"""Template builds (issue 17): the build job (`runner`) and how the Deployer asks for,
queues and recovers them (`service`). The image side is bot/images/."""
