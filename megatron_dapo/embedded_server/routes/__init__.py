"""The embedded server's routes, one `APIRouter` per concern; each reaches the server through `StateDep`."""
