"""The template builder's host side (issue 17): OS build profiles (`profiles`), verified
downloads into a content-addressed cache (`fetch`) and offline customisation with
libguestfs (`customize`), tied together by `prepare.prepare_image`."""
