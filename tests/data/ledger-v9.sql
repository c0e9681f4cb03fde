-- xpud ledger schema v9, written by xpud 0.1.0 (commit b636624) on the simulated
-- workstation-2x; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.
PRAGMA user_version=9;
BEGIN TRANSACTION;
CREATE TABLE auto_leases (
        lease_id TEXT PRIMARY KEY,
        job_class TEXT NOT NULL,
        auto INTEGER NOT NULL,        
        moves INTEGER NOT NULL DEFAULT 0,
        last_move REAL,               
        last_direction TEXT NOT NULL DEFAULT ''
    );
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
INSERT INTO "events" VALUES(1,1.79663789462401485438e+09,'mode',0,'','card 0 switched to sliced for lease d490b9ab: a vxpu-half request found no room on a sliced card');
INSERT INTO "events" VALUES(2,1.79663789462403321265e+09,'grant',0,'d490b9ab','lease d490b9ab (vxpu-half) on card 0 to uid 0');
INSERT INTO "events" VALUES(3,1.79663789463335156438e+09,'grant',0,'3a924c42','lease 3a924c42 (vxpu-quarter) on card 0 to uid 0');
INSERT INTO "events" VALUES(4,1.79663789464087963101e+09,'grant',1,'7a7ec35e','lease 7a7ec35e (xpu) on card 1 to uid 0');
INSERT INTO "events" VALUES(5,1.79663789464607357975e+09,'release',0,'3a924c42','lease 3a924c42 released: released by uid 0 (its command exited 3)');
INSERT INTO "events" VALUES(6,1.79663789466143631939e+09,'drain',1,'','card 1 drained: fixture: drained before the upgrade');
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
CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL DEFAULT '',
        kind TEXT NOT NULL,           
        uid INTEGER NOT NULL,
        gid INTEGER NOT NULL,
        cwd TEXT NOT NULL DEFAULT '',
        argv TEXT NOT NULL DEFAULT '[]',  
        env TEXT NOT NULL DEFAULT '{}',   
        spec TEXT NOT NULL DEFAULT '{}',  
        hosts TEXT NOT NULL DEFAULT '[]', 
        lease_id TEXT NOT NULL DEFAULT '',
        state TEXT NOT NULL,
        exit_code INTEGER,
        exit_signal INTEGER,
        submitted REAL NOT NULL,
        started REAL,
        ended REAL,
        reason TEXT NOT NULL DEFAULT ''
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
    , started REAL, exit_code INTEGER, exit_signal INTEGER, name TEXT NOT NULL DEFAULT '', anchor TEXT NOT NULL DEFAULT '');
INSERT INTO "leases" VALUES('d490b9ab','c3466247b6870a6554950c2cae86fed3e019ab02e4632bd7d2aab7721ae2201a','vxpu-half',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-half", "memory_bytes": 25226641408, "compute_pct": 30, "handle": "mps:0:d490b9ab", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=24058M", "XPU_MEMORY_LIMIT_BYTES": "25226641408", "XPU_COMPUTE_PCT": "30", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-x6734fc4/run/mps/0/pipe", "XPU_LEASE_ID": "d490b9ab", "XPU_MODE": "vxpu-half", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,27998,'python serve.py',1.79663789462382364275e+09,'active',NULL,'',0,'',NULL,NULL,NULL,'','');
INSERT INTO "leases" VALUES('3a924c42','2de93a7f3b15482f8e2dac31d93efcc480b768b743409f03ba4d3d08e62ba771','vxpu-quarter',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-quarter", "memory_bytes": 12613320704, "compute_pct": 15, "handle": "mps:0:3a924c42", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12029M", "XPU_MEMORY_LIMIT_BYTES": "12613320704", "XPU_COMPUTE_PCT": "15", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-x6734fc4/run/mps/0/pipe", "XPU_LEASE_ID": "3a924c42", "XPU_MODE": "vxpu-quarter", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,27998,'python infer.py',1.7966378946332564354e+09,'released',1.79663789464606642718e+09,'released by uid 0',0,'',1.7966378946332564354e+09,3,NULL,'','');
INSERT INTO "leases" VALUES('7a7ec35e','57dc785f690fe86aeceebd051d521ff4fefe90dba320076d1593cf5580c9c416','xpu',0,'[1]','["GPU-534a60eb-8afd-55d0-a311-8906dc696a01"]','[]','{"CUDA_VISIBLE_DEVICES": "GPU-534a60eb-8afd-55d0-a311-8906dc696a01", "XPU_LEASE_ID": "7a7ec35e", "XPU_MODE": "xpu", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,27998,'python train.py',1.79663789464078307153e+09,'active',NULL,'',0,'',NULL,NULL,NULL,'','');
CREATE TABLE mig_made (
        card_uuid TEXT NOT NULL,
        start INTEGER NOT NULL,       
        profile_id INTEGER NOT NULL,  
        device_uuid TEXT NOT NULL DEFAULT '',  
        created REAL NOT NULL,
        PRIMARY KEY (card_uuid, start)
    );
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
        ended REAL,
        rank_pid INTEGER NOT NULL DEFAULT 0  
    );
CREATE TABLE standby (
        handle TEXT PRIMARY KEY,      
        card_uuid TEXT NOT NULL,
        size TEXT NOT NULL,
        slice TEXT NOT NULL,          
        created REAL NOT NULL
    );
CREATE TABLE usage_readings (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_class TEXT NOT NULL,
        ts REAL NOT NULL,             
        sm_pct REAL,                  
        membw_pct REAL,
        mem_bytes INTEGER,
        cap_pct REAL NOT NULL,
        mem_cap_bytes INTEGER NOT NULL
    );
CREATE INDEX leases_by_state ON leases(state);
CREATE INDEX health_changes_by_card ON health_changes(card_uuid, id);
CREATE INDEX reservations_by_state ON reservations(state);
CREATE INDEX events_by_lease ON events(lease_id, id);
CREATE INDEX events_by_card ON events(card, id);
CREATE INDEX usage_readings_by_class ON usage_readings(job_class, id);
CREATE INDEX jobs_by_state ON jobs(state);
CREATE INDEX jobs_by_name ON jobs(uid, name);
CREATE INDEX jobs_by_submitted ON jobs(submitted);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',6);
COMMIT;
