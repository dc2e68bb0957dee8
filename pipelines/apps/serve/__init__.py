"""`xmodal serve`: a web page and a JSON API over a detector and a fine-tuned model held in memory.

`config.ServeConfig` (settings), `backend.load_backend` (the models), `app.create_app` (the application).
"""
