"""`xmodal serve`: a web page and a JSON API over a detector and a fine-tuned model held in memory."""

from pipelines.apps.serve.app import ServeConfig, create_app
from pipelines.apps.serve.backend import Answered, Backend, load_backend

__all__ = ["Answered", "Backend", "ServeConfig", "create_app", "load_backend"]
