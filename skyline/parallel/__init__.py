"""Process groups, collectives and placement: how a model's layers and heads are spread over
ranks (tensor parallel), stages (pipeline parallel) and possibly unequal devices. Layers hold a
`Group` and call its collectives; nothing here knows a model."""
