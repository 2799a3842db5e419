"""An organization's own code, outside hetfed's package: model builders and a data factory the tests federate.

Nothing here imports hetfed: an organization's package needs only torch (docs/models.md, docs/data.md).
"""
