"""The course on JupyterHub: jupyterhub_config.py, start.py (make hub), exchange.py."""
