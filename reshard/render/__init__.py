"""Reports rendered for terminals, Markdown, JSON and PNG figures."""
