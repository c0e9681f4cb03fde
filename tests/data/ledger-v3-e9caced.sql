-- xpud ledger schema v3, written by xpud 0.1.0 (commit e9caced) on the simulated
-- workstation-2x; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.
PRAGMA user_version=3;
BEGIN TRANSACTION;
CREATE TABLE cards (
        uuid TEXT PRIMARY KEY,
        mode TEXT NOT NULL,
        mode_pinned INTEGER NOT NULL DEFAULT 0,
        drained INTEGER NOT NULL DEFAULT 0,
        drain_reason TEXT NOT NULL DEFAULT ''
    );
INSERT INTO "cards" VALUES('GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead','sliced',0,0,'');
INSERT INTO "cards" VALUES('GPU-534a60eb-8afd-55d0-a311-8906dc696a01','whole',0,1,'fixture: drained before the upgrade');
CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        card INTEGER NOT NULL DEFAULT -1,
        lease_id TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL
    );
INSERT INTO "events" VALUES(1,1.79664413790045070654e+09,'mode',0,'','card 0 switched to sliced for lease 838b334f');
INSERT INTO "events" VALUES(2,1.79664413790054178243e+09,'grant',0,'838b334f','lease 838b334f (vxpu-half) on card 0 to uid 0');
INSERT INTO "events" VALUES(3,1.79664413790430569652e+09,'grant',0,'cc6ccc03','lease cc6ccc03 (vxpu-quarter) on card 0 to uid 0');
INSERT INTO "events" VALUES(4,1.79664413790652036668e+09,'grant',1,'81bc3993','lease 81bc3993 (xpu) on card 1 to uid 0');
INSERT INTO "events" VALUES(5,1.79664413791436743733e+09,'release',0,'cc6ccc03','lease cc6ccc03 released: released by uid 0');
INSERT INTO "events" VALUES(6,1796644137.92181,'drain',1,'','card 1 drained: fixture: drained before the upgrade');
CREATE TABLE health_changes (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        card_uuid TEXT NOT NULL,
        card INTEGER NOT NULL,        
        from_state TEXT NOT NULL,
        to_state TEXT NOT NULL,
        score INTEGER NOT NULL,
        reasons TEXT NOT NULL         
    );
CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        token_hash TEXT NOT NULL,
        mode TEXT NOT NULL,
        owner_uid INTEGER NOT NULL,
        cards TEXT NOT NULL,          
        card_uuids TEXT NOT NULL,     
        slices TEXT NOT NULL,         
        env TEXT NOT NULL,            
        priority INTEGER NOT NULL,
        restartable INTEGER NOT NULL,
        holder_pid INTEGER,
        command TEXT NOT NULL,
        created REAL NOT NULL,
        state TEXT NOT NULL,
        ended REAL,
        end_reason TEXT NOT NULL DEFAULT '',
        restart_count INTEGER NOT NULL DEFAULT 0,
        mark TEXT NOT NULL DEFAULT ''
    );
INSERT INTO "leases" VALUES('838b334f','799ccf53e759d716e0d67393a2da60001b33f51eb8d1990b4c9ccd496e5c70f9','vxpu-half',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-half", "memory_bytes": 25226641408, "compute_pct": 30, "handle": "mps:0:838b334f", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-vv_dn7es/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=24058M", "XPU_MEMORY_LIMIT_BYTES": "25226641408", "XPU_COMPUTE_PCT": "30", "XPU_LEASE_ID": "838b334f", "XPU_MODE": "vxpu-half", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,17036,'python serve.py',1.79664413789315414431e+09,'active',NULL,'',0,'');
INSERT INTO "leases" VALUES('cc6ccc03','2cde11191b675849c505cf64f72847bb3dd81ae94d502df3e805bdd548c6e708','vxpu-quarter',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-quarter", "memory_bytes": 12613320704, "compute_pct": 15, "handle": "mps:0:cc6ccc03", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-vv_dn7es/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12029M", "XPU_MEMORY_LIMIT_BYTES": "12613320704", "XPU_COMPUTE_PCT": "15", "XPU_LEASE_ID": "cc6ccc03", "XPU_MODE": "vxpu-quarter", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,17036,'python infer.py',1.79664413790384125705e+09,'released',1.7966441379139897823e+09,'released by uid 0',0,'');
INSERT INTO "leases" VALUES('81bc3993','e43defaac4055452f6a63b1c554c9afb2e32c8a374acf7a61346da78c468f2c7','xpu',0,'[1]','["GPU-534a60eb-8afd-55d0-a311-8906dc696a01"]','[]','{"CUDA_VISIBLE_DEVICES": "GPU-534a60eb-8afd-55d0-a311-8906dc696a01", "XPU_LEASE_ID": "81bc3993", "XPU_MODE": "xpu", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,17036,'python train.py',1.79664413790612292288e+09,'active',NULL,'',0,'');
CREATE TABLE reservations (
        job TEXT PRIMARY KEY,
        attempt INTEGER NOT NULL,
        coordinator TEXT NOT NULL,
        lease_id TEXT NOT NULL,
        cards TEXT NOT NULL,          
        ttl_s REAL NOT NULL,
        created REAL NOT NULL,
        expires REAL NOT NULL,
        state TEXT NOT NULL,          
        ended REAL
    );
CREATE INDEX leases_by_state ON leases(state);
CREATE INDEX health_changes_by_card ON health_changes(card_uuid, id);
CREATE INDEX reservations_by_state ON reservations(state);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',6);
COMMIT;
