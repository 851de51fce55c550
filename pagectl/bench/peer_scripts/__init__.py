"""Scripts run by a peer's own interpreter (its venv), never imported by pagectl: they may
import only the peer's packages and the standard library."""
