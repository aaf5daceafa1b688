"""Can the model hub give a tokenizer named by its hub name? Asked once, in a few seconds.

Offline, transformers retries the hub for about a minute (five retries with backoff) before it says
it could not connect, and a gated or missing repository is told in a paragraph that names neither
the config key nor a way out. One HEAD request for the repository's ``tokenizer_config.json``, with
no retry and a short timeout, tells all of these apart; the loader then takes the tokenizer from the
local hub cache if it is there, or says in one line what to do (``TokenizerUnavailable``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROBE_TIMEOUT_S = 5.0  # connect and answer: the hub answers a HEAD in well under a second when reachable
NO_TOKENIZERS_HINT = "; or check the rest of the config without them: --no-tokenizers"


class TokenizerUnavailable(ValueError):
    """A model's tokenizer cannot be had here; the message says why and what to do, in one line."""


@dataclass(frozen=True)
class HubProblem:
    """Why the hub cannot give a repository's files (``what``), and what to do instead (``advice``)."""

    what: str
    advice: str
    chosen: bool = False  # offline on purpose: a tokenizer from the cache is what was asked for

    def unavailable(self) -> TokenizerUnavailable:
        """The error once the local hub cache does not hold the tokenizer either."""
        return TokenizerUnavailable(f"{self.what}, and the local hub cache does not hold it: {self.advice}")


def is_local(name: str) -> bool:
    """A folder (or file) on this machine, which transformers reads without the hub."""
    return os.path.exists(name)


def probe(
    name: str, revision: str | None = None, timeout: float = PROBE_TIMEOUT_S, endpoint: str | None = None
) -> HubProblem | None:
    """None when the hub (``endpoint``, default ``HF_ENDPOINT``'s) can give ``name``'s files
    (loading then goes on as usual, downloads included); else why not. Offline mode
    (``HF_HUB_OFFLINE``) is a problem too: only the cache can serve, and if it does not hold the
    tokenizer the advice says how to fill it."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils._validators import validate_repo_id  # not re-exported for type checkers

    endpoint = endpoint or constants.ENDPOINT
    local = "or give a local folder as the tokenizer"
    download = f"download it where the hub is reachable (hf download {name}; HF_HUB_OFFLINE=1 then uses that copy)"
    if constants.HF_HUB_OFFLINE:
        return HubProblem("HF_HUB_OFFLINE is set", f"{download}, {local}", chosen=True)
    try:
        validate_repo_id(name)  # a path that is not there: no request for it
        url = hf_hub_url(name, "tokenizer_config.json", revision=revision, endpoint=endpoint)
        get_hf_file_metadata(url, timeout=timeout)  # no retry unless asked (retry_on_errors)
    except HFValidationError:
        return HubProblem(
            "no such folder on this machine, and not a hub name (org/model)", "give an existing folder or a hub name"
        )
    except GatedRepoError:  # before RepositoryNotFoundError: it is one
        return HubProblem(
            "the hub repository is gated and this machine's token has no access",
            f"accept its terms on the hub and set HF_TOKEN (or `hf auth login`), {local}",
        )
    except RepositoryNotFoundError:
        return HubProblem(
            "no such repository on the hub (or it is private)",
            f"check the name, or set HF_TOKEN for a private one, {local}",
        )
    except RevisionNotFoundError:
        return HubProblem(f"the hub repository has no revision {revision!r}", f"check tokenizer_revision, {local}")
    except EntryNotFoundError:
        return None  # reachable, the repository is there: transformers finds what it has
    except HfHubHTTPError as err:
        return HubProblem(
            f"the hub ({endpoint}) answered {err.response.status_code}", f"try again later, {download}, {local}"
        )
    except Exception as err:  # the network's errors: no route, no name resolution, a timeout, TLS
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return HubProblem(f"the hub ({endpoint}) is unreachable ({cause})", f"{download}, {local}")
    return None
