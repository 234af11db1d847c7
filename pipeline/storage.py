"""Opening storage: a folder or fsspec URL (a manifest SOURCE too) to its file system, and the one-line message of a
storage error that stops a run before it starts."""

from __future__ import annotations

from typing import Any, Mapping

import fsspec

from pipeline.errors import ConfigError

URIS_FORM = "uris+"  # SOURCE = uris+URL: a text, CSV or Parquet file (or a folder of them) with one URI per row
INVENTORY_FORM = "inventory+"  # SOURCE = inventory+s3://bucket/…/manifest.json: an S3 Inventory report
MANIFEST_FORMS = (URIS_FORM, INVENTORY_FORM)


def manifest_form(source: str) -> tuple[str, str] | None:
    """``(form, url)`` of a manifest SOURCE (``uris+…``, ``inventory+…``); None for a folder or prefix."""
    for form in MANIFEST_FORMS:
        if source.startswith(form):
            url = source[len(form):]
            if not url:
                raise ConfigError(f"SOURCE {source!r} names no file; write e.g. {form}s3://bucket/list.parquet")
            return form, url
    return None


def open_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a folder or fsspec URL to (filesystem, path); an unknown scheme fails with the package to install.

    A manifest SOURCE (``uris+URL``, ``inventory+URL``) resolves to the manifest's file system and path.
    """
    form = manifest_form(url)
    url = form[1] if form else url
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as err:
        raise ConfigError(f"cannot open {url!r}: {err}; install the fsspec package for that scheme") from None
    except ValueError as err:
        if "Protocol not known" in str(err):
            scheme = url.split("://", 1)[0]
            raise ConfigError(f"cannot open {url!r}: unknown scheme {scheme!r}; use a folder, file:// or s3://, "
                              "or install the fsspec package for that scheme") from None
        raise ConfigError(f"cannot open {url!r}: {err}; check the URL and --storage-option values") from None
    except TypeError as err:
        raise ConfigError(f"bad --storage-option for {url!r}: {err}") from None


def missing_filesystem(scheme: str) -> str | None:
    """Why no fsspec file system opens ``scheme://`` URLs here, in fsspec's words where it knows the scheme ("Please
    install gcsfs to access Google Storage"); None when one does."""
    for protocol in scheme.split("::"):  # a chained URL (simplecache::s3) needs each
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as err:
            return str(err)
        except ValueError:
            return f"fsspec knows no scheme {protocol!r}"
    return None


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def storage_failure(url: str, err: BaseException) -> str:
    """One line for a storage error that stops a run before it starts, with the usual fixes."""
    text = f"{type(err).__name__}: {err}".strip().replace("\n", " ")
    hint = "check the URL, credentials (AWS_* environment or --storage-option) and AWS_ENDPOINT_URL"
    if isinstance(err, PermissionError):
        hint = "check the credentials and the bucket policy (AWS_* environment or --storage-option)"
    return f"cannot read {url!r}: {text[:300]}; {hint}"
