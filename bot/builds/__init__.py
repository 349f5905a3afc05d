"""Template builds (issue 17): the build job (`runner`) and how the Deployer asks for,
queues and recovers them (`service`). The image side is bot/images/."""

from bot.builds.runner import BuildFailed, BuildNotes, BuildRunner, LoggedBuildNotes
from bot.builds.service import Builds

__all__ = ["BuildFailed", "BuildNotes", "BuildRunner", "Builds", "LoggedBuildNotes"]
