"""Who may do what: the API's tokens (`auth`), the node daemons' credentials (`nodeauth`), tenant policies and
admission (`tenancy`), the endpoint and model allow-lists (`allowlists`). Next: the routes (`controller/http/`) ask."""
