BEGIN TRANSACTION;
CREATE TABLE changes (
	rv INTEGER NOT NULL, 
	type VARCHAR NOT NULL, 
	name VARCHAR NOT NULL, 
	object VARCHAR NOT NULL, 
	PRIMARY KEY (rv)
);
INSERT INTO "changes" VALUES(1,'ADDED','before-upgrade','{"apiVersion":"rolloutd.io/v1alpha1","kind":"RolloutJob","metadata":{"creationTimestamp":"2026-11-28T14:17:19Z","generation":1,"labels":{"team":"rl"},"name":"before-upgrade","resourceVersion":"1","uid":"9c6e5a22-513b-4b78-867f-fd9c279ba118"},"spec":{"agent":{"command":null,"driftCheck":false,"kind":"loop","maxTurns":4,"sampling":{"frequencyPenalty":null,"maxTokensPerTurn":256,"maxTotalTokens":2048,"minP":null,"presencePenalty":null,"repetitionPenalty":null,"seed":7,"stop":[],"temperature":1.0,"topK":null,"topP":1.0},"tools":["bash","ipython","editor","submit"]},"batches":null,"dapo":{"band":null,"carryOver":false,"enabled":false,"filter":"zeroVariance","maxInFlightGroups":null,"targetGroups":16},"executor":{"kind":"local","nodes":2,"slurm":{"account":null,"constraint":null,"extraArgs":[],"partition":"debug","qos":null,"setup":[],"timeLimit":"01:00:00"}},"llm":{"backends":[{"name":null,"url":"http://127.0.0.1:8000"}],"model":null,"tokenizer":"models/smollm2-135m-instruct"},"pipeline":{"leaseSeconds":30.0,"maxAttempts":3,"workersPerNode":{"eval":8,"init":8,"run":32}},"policy":{"maxStaleness":null,"pauseOnUpdate":true},"samplesPerPrompt":4,"sandbox":{"image":"host","limits":{"fileSizeMB":1024,"memoryMB":1024,"processes":256,"wallSeconds":600},"mounts":[],"network":false,"runtime":"bwrap","warm":2},"tasks":{"kind":"math","limit":32,"source":"examples/math/train.jsonl"},"timeouts":{"actionSeconds":60.0,"evalSeconds":600.0,"initSeconds":120.0,"runSeconds":900.0}},"status":{"batch":null,"completionTime":null,"conditions":[],"counts":{"cancelled":0,"eval":0,"failed":0,"init":0,"queued":0,"run":0,"succeeded":0,"total":0},"message":"","nodes":0,"observedGeneration":0,"phase":"Pending","policyVersion":null,"startTime":null}}');
INSERT INTO "changes" VALUES(2,'MODIFIED','before-upgrade','{"apiVersion":"rolloutd.io/v1alpha1","kind":"RolloutJob","metadata":{"creationTimestamp":"2026-11-28T14:17:19Z","generation":1,"labels":{"team":"rl"},"name":"before-upgrade","resourceVersion":"2","uid":"9c6e5a22-513b-4b78-867f-fd9c279ba118"},"spec":{"agent":{"command":null,"driftCheck":false,"kind":"loop","maxTurns":4,"sampling":{"frequencyPenalty":null,"maxTokensPerTurn":256,"maxTotalTokens":2048,"minP":null,"presencePenalty":null,"repetitionPenalty":null,"seed":7,"stop":[],"temperature":1.0,"topK":null,"topP":1.0},"tools":["bash","ipython","editor","submit"]},"batches":null,"dapo":{"band":null,"carryOver":false,"enabled":false,"filter":"zeroVariance","maxInFlightGroups":null,"targetGroups":16},"executor":{"kind":"local","nodes":2,"slurm":{"account":null,"constraint":null,"extraArgs":[],"partition":"debug","qos":null,"setup":[],"timeLimit":"01:00:00"}},"llm":{"backends":[{"name":null,"url":"http://127.0.0.1:8000"}],"model":null,"tokenizer":"models/smollm2-135m-instruct"},"pipeline":{"leaseSeconds":30.0,"maxAttempts":3,"workersPerNode":{"eval":8,"init":8,"run":32}},"policy":{"maxStaleness":null,"pauseOnUpdate":true},"samplesPerPrompt":4,"sandbox":{"image":"host","limits":{"fileSizeMB":1024,"memoryMB":1024,"processes":256,"wallSeconds":600},"mounts":[],"network":false,"runtime":"bwrap","warm":2},"tasks":{"kind":"math","limit":32,"source":"examples/math/train.jsonl"},"timeouts":{"actionSeconds":60.0,"evalSeconds":600.0,"initSeconds":120.0,"runSeconds":900.0}},"status":{"batch":null,"completionTime":null,"conditions":[],"counts":{"cancelled":0,"eval":0,"failed":0,"init":0,"queued":0,"run":0,"succeeded":0,"total":0},"message":"","nodes":0,"observedGeneration":0,"phase":"Succeeded","policyVersion":null,"startTime":null}}');
CREATE TABLE events (
	id INTEGER NOT NULL, 
	name VARCHAR NOT NULL, 
	time DATETIME NOT NULL, 
	type VARCHAR NOT NULL, 
	reason VARCHAR NOT NULL, 
	message VARCHAR NOT NULL, 
	PRIMARY KEY (id)
);
CREATE TABLE jobs (
	name VARCHAR NOT NULL, 
	uid VARCHAR NOT NULL, 
	generation INTEGER NOT NULL, 
	resource_version INTEGER NOT NULL, 
	labels VARCHAR NOT NULL, 
	annotations VARCHAR NOT NULL, 
	spec VARCHAR NOT NULL, 
	status VARCHAR NOT NULL, 
	created DATETIME NOT NULL, 
	deleted DATETIME, 
	PRIMARY KEY (name)
);
INSERT INTO "jobs" VALUES('before-upgrade','9c6e5a22-513b-4b78-867f-fd9c279ba118',1,2,'{"team":"rl"}','{}','{"agent":{"command":null,"driftCheck":false,"kind":"loop","maxTurns":4,"sampling":{"frequencyPenalty":null,"maxTokensPerTurn":256,"maxTotalTokens":2048,"minP":null,"presencePenalty":null,"repetitionPenalty":null,"seed":7,"stop":[],"temperature":1.0,"topK":null,"topP":1.0},"tools":["bash","ipython","editor","submit"]},"batches":null,"dapo":{"band":null,"carryOver":false,"enabled":false,"filter":"zeroVariance","maxInFlightGroups":null,"targetGroups":16},"executor":{"kind":"local","nodes":2,"slurm":{"account":null,"constraint":null,"extraArgs":[],"partition":"debug","qos":null,"setup":[],"timeLimit":"01:00:00"}},"llm":{"backends":[{"name":null,"url":"http://127.0.0.1:8000"}],"model":null,"tokenizer":"models/smollm2-135m-instruct"},"pipeline":{"leaseSeconds":30.0,"maxAttempts":3,"workersPerNode":{"eval":8,"init":8,"run":32}},"policy":{"maxStaleness":null,"pauseOnUpdate":true},"samplesPerPrompt":4,"sandbox":{"image":"host","limits":{"fileSizeMB":1024,"memoryMB":1024,"processes":256,"wallSeconds":600},"mounts":[],"network":false,"runtime":"bwrap","warm":2},"tasks":{"kind":"math","limit":32,"source":"examples/math/train.jsonl"},"timeouts":{"actionSeconds":60.0,"evalSeconds":600.0,"initSeconds":120.0,"runSeconds":900.0}}','{"batch":null,"completionTime":null,"conditions":[],"counts":{"cancelled":0,"eval":0,"failed":0,"init":0,"queued":0,"run":0,"succeeded":0,"total":0},"message":"","nodes":0,"observedGeneration":0,"phase":"Succeeded","policyVersion":null,"startTime":null}','2026-11-28 14:17:19.000000',NULL);
CREATE TABLE schema_version (
	id INTEGER NOT NULL, 
	version INTEGER NOT NULL, 
	PRIMARY KEY (id)
);
INSERT INTO "schema_version" VALUES(1,1);
CREATE INDEX ix_changes_name ON changes (name);
CREATE INDEX ix_events_name ON events (name);
COMMIT;
