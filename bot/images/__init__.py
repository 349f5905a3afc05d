"""The template builder's host side (issue 17): OS build profiles (`profiles`), verified
downloads into a content-addressed cache (`fetch`) and offline customisation with
libguestfs (`customize`), tied together by `prepare.prepare_image`."""

from bot.images.customize import CustomizeError
from bot.images.fetch import FetchError
from bot.images.prepare import PreparedImage, PrepareError, prepare_image
from bot.images.profiles import ImagesSettings, Profile, ProfileError, catalogue

__all__ = [
    "CustomizeError",
    "FetchError",
    "ImagesSettings",
    "PrepareError",
    "PreparedImage",
    "Profile",
    "ProfileError",
    "catalogue",
    "prepare_image",
]
