"""One module per command, each orchestrating the layers below."""
